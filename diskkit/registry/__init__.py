"""The OCI distribution API client: auth (skopeo's and podman's credential files), TLS,
retries and resumable blob transfers, and the options every registry-facing command takes.
It moves bytes and verifies them; it does not know what an image means (see diskkit.transports)."""
