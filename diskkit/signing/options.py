"""What the signature flags carry, apart from the code that acts on them: every CLI run builds
these, and importing diskkit.signing.trust would load cryptography for commands that never sign."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrustOptions:
    """--signature-policy and --registries.d, as skopeo takes them; None means the standard places."""

    policy: Path | None = None
    registries_d: Path | None = None


@dataclass(frozen=True)
class SignOptions:
    """--sign-by-sigstore-private-key, --sign-passphrase-file and where attachments may be written."""

    key: Path
    passphrase_file: Path | None = None
    registries_d: Path | None = None
