"""The flags every registry-facing command takes; kept apart so local-only commands never load an HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegistryOptions:
    """--tls-verify, --cert-dir, --authfile, --creds and the retry policy, as skopeo's subcommands take them."""

    tls_verify: bool = True
    cert_dir: str | None = None
    authfile: str | None = None
    creds: str | None = None
    retries: int = 5
    backoff: float = 0.5  # first delay in seconds; doubles per attempt, with jitter
    max_delay: float = 30.0
    timeout: float = 60.0
