"""The OCI distribution API client: auth (skopeo's and podman's credential files), TLS,
retries and resumable blob transfers, the options every registry-facing command takes, and
registries.conf (where a name is pulled from: mirrors, insecure, blocked, short names).
It moves bytes and verifies them; it does not know what an image means (see diskkit.transports)."""
