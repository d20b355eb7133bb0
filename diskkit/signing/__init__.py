"""Sigstore signatures on containerDisks: keys, the simple-signing payload, attachment tags, policy.json.

Sits above transports (it reads and writes `sha256-<hex>.sig` tags through the registry client) and
below ops; it never touches disks or layers. Every CLI run imports `options` (the flags' values);
`keys` (cryptography, nacl), `sigstore` and `registriesd` (yaml) are imported where they are used,
so a command that neither signs nor meets a policy naming keys never loads them
(tests/test_startup.py).
"""
