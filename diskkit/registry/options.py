"""The flags every registry-facing command takes; kept apart so local-only commands never load an HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diskkit.registry.authfile import Credentials
    from diskkit.registry.tlsfiles import Identity


@dataclass(frozen=True)
class RegistryOptions:
    """--tls-verify, --cert-dir, --authfile, --creds and the retry policy, as skopeo's subcommands take them."""

    # None: not given, so registries.conf's `insecure` decides, else TLS is verified; True/False: the
    # user's word, which registries.conf cannot change (skopeo's OptionalBool;
    # containers/image docker/docker_client.go: detectPropertiesHelper).
    tls_verify: bool | None = None
    cert_dir: str | None = None
    authfile: str | None = None
    creds: str | None = None
    retries: int = 5
    backoff: float = 0.5  # first delay in seconds; doubles per attempt, with jitter
    max_delay: float = 30.0
    timeout: float = 60.0
    # Where the policy a read must pass lives, as containers/image's SystemContext carries it
    # (SignaturePolicyPath, RegistriesDirPath): None is the standard places. It travels with the other
    # options so that every read of a command, a disk server's included, answers to the same policy.
    signature_policy: str | None = None
    registries_d: str | None = None
    # Public keys (sigstore PEM files, GnuPG keyrings) one of which must have signed a passed
    # boot-test attestation of each manifest read (launcher test --attest-*). policy.json cannot say
    # it: containers/image refuses requirement types it does not know.
    boot_test_keys: tuple[str, ...] = ()
    boot_test_gpg_keys: tuple[str, ...] = ()
    # Credentials given inline per registry host, as a node's disk server gets them from a client of
    # another user: when set, the only ones used (never --creds, an auth file or this process's
    # environment); () is anonymous.
    inline_credentials: tuple[tuple[str, Credentials], ...] | None = None
    # TLS client identities given inline per registry host, for the same reason: when set, the only
    # ones presented (never a NAME.cert/NAME.key of --cert-dir or certs.d, which are this process's
    # user's); () is none. The CAs (*.crt) there still hold: trust is not identity (registry.tlsfiles).
    inline_identities: tuple[tuple[str, Identity], ...] | None = None

    def for_endpoint(self, insecure: bool = False) -> "RegistryOptions":
        """The options for one registry endpoint, `tls_verify` settled: registries.conf's `insecure`
        for it applies only where no flag was given."""
        if self.tls_verify is not None:
            return self
        return replace(self, tls_verify=not insecure)
