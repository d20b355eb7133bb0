"""Sigstore signatures on containerDisks: keys, the simple-signing payload, attachment tags, policy.json.

Sits above transports (it reads and writes `sha256-<hex>.sig` tags through the registry client) and
below ops; it never touches disks or layers.
"""
