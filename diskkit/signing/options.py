"""What the signature flags carry, apart from the code that acts on them: every CLI run builds
these, and importing diskkit.signing.trust would load cryptography for commands that never sign."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diskkit.registry.options import RegistryOptions


@dataclass(frozen=True)
class TrustOptions:
    """--signature-policy and --registries.d, as skopeo takes them; None means the standard places."""

    policy: Path | None = None
    registries_d: Path | None = None
    boot_test_keys: tuple[str, ...] = ()
    boot_test_gpg_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, registry: RegistryOptions | None) -> "TrustOptions":
        """The policy named by a command's registry options (the launcher's flags), else the standard places."""
        if registry is None:
            return cls()
        return cls(Path(registry.signature_policy) if registry.signature_policy else None,
                   Path(registry.registries_d) if registry.registries_d else None,
                   tuple(registry.boot_test_keys), tuple(registry.boot_test_gpg_keys))


@dataclass(frozen=True)
class SignOptions:
    """--sign-by-sigstore-private-key or --sign-by (a GnuPG key's fingerprint), --sign-passphrase-file
    and the registries.d that says where attachments and lookaside signatures may be written."""

    key: Path | None
    passphrase_file: Path | None = None
    registries_d: Path | None = None
    sign_by: str | None = None
