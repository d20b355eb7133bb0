"""The signature flags, kept apart from the registry flags: a policy for reading, a key for signing."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from diskkit.signing.options import SignOptions, TrustOptions

_FILE = click.Path(dir_okay=False, path_type=Path)


def signature_options(policy: bool = True, sign: bool = True):
    """skopeo's flags, folded into `trust: TrustOptions` (with policy) and `sign: SignOptions | None` (with sign)."""

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, registries_d, signature_policy=None, sign_by_sigstore_private_key=None, sign_by=None, sign_passphrase_file=None,
                    require_boot_test_key=(), require_boot_test_gpg_key=(), **kwargs):
            if policy:
                kwargs["trust"] = TrustOptions(signature_policy, registries_d, tuple(map(str, require_boot_test_key)), tuple(map(str, require_boot_test_gpg_key)))
            if sign:
                if sign_passphrase_file and not (sign_by_sigstore_private_key or sign_by):
                    raise click.UsageError("--sign-passphrase-file needs --sign-by or --sign-by-sigstore-private-key")
                if sign_by and sign_by_sigstore_private_key:  # skopeo copy.go: one signature format at a time
                    raise click.UsageError("Only one of --sign-by and sign-by-sigstore-private-key can be used with sign-passphrase-file")
                signs = sign_by_sigstore_private_key or sign_by
                kwargs["sign"] = SignOptions(sign_by_sigstore_private_key, sign_passphrase_file, registries_d, sign_by) if signs else None
            return command(*args, **kwargs)

        options = [click.option("--registries.d", "registries_d", type=click.Path(file_okay=False, path_type=Path), help="registries.d directory: lookaside stores and use-sigstore-attachments (default: ~/.config/containers/registries.d, else /etc/containers/registries.d).")]
        if policy:
            options.append(click.option("--signature-policy", type=_FILE, help="policy.json to enforce (default: ~/.config/containers/policy.json, else /etc/containers/policy.json; with neither, everything is accepted)."))
            options.append(click.option("--require-boot-test-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), multiple=True,
                                        help="Read only images with a passed boot-test attestation (launcher test --attest-*) of each manifest read, signed by this sigstore public key (repeatable: any one of them)."))
            options.append(click.option("--require-boot-test-gpg-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), multiple=True,
                                        help="As --require-boot-test-key, for an attestation signed with GnuPG: a keyring file (gpg --export) of accepted keys (repeatable)."))
        if sign:
            options.append(click.option("--sign-passphrase-file", type=_FILE, help="Read the key's passphrase from this file (else it is asked on the terminal)."))
            options.append(click.option("--sign-by", metavar="FINGERPRINT", help="Sign with this key of your GnuPG keyring ($GNUPGHOME) as a GPG simple signature in the registries.d lookaside store."))
            options.append(click.option("--sign-by-sigstore-private-key", type=_FILE, metavar="FILE", help="Sign the pushed image (and each manifest of an index) with this sigstore key."))
        for option in options:
            wrapper = option(wrapper)
        return wrapper

    return decorate
