"""Signatures on containerDisks, in both formats containers/image enforces: sigstore (keys, `.sig`
attachments) and GPG simple signing (`openpgp` drives gpg; `lookaside` stores, `simple` signs on
push and carries signatures on copy); the payload both cover; policy.json and registries.d;
boot-test attestations (`attestation`: in-toto statements in DSSE envelopes, pure) and the OCI 1.1
referrers they are stored as (`referrers`).

Sits above transports (it reads and writes `sha256-<hex>.sig` tags through the registry client and
signs through a destination's before_manifest hook) and below ops; it never touches disks or
layers. Every CLI run imports `options` (the flags' values); `keys` (cryptography, nacl),
`sigstore`, `registriesd` (yaml), `openpgp`, `lookaside` and `simple` are imported where they are
used, so a command that neither signs nor meets a policy naming keys never loads them
(tests/test_startup.py).
"""
