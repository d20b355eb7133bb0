"""The registry options a disk server request is served with: what its client holds, never what the
node holds, for another user.

A root disk server takes requests from the local users in its socket group. Whatever lets a request
in at a registry is a credential and belongs to whoever holds it: an auth file entry, a VMI's
imagePullSecret, a TLS client key. The node's own (the server's auth file and `--creds`, the
client certificate in its `--cert-dir` or certs.d) serve root and the server's own user. A client of
another uid is fetched for with what it sent inline, or with nothing, and the manifest read with
those is what lets it have an export, even of an image the node holds already (pulled or exported),
as the kubelet's "ensure secret pulled images" (keps/sig-node/2535-ensure-secret-pulled-images)
serves a cached image to a pod only once the pod's own credentials could pull it.

What is not a credential stays the node's for every client: the CAs its registries' certificates
chain to (trust), the signature policy and the boot-test requirement. Files a request names are read
only for a client as privileged as the server, so a user in the socket group can make a root server
read none of another user's files.
"""

from __future__ import annotations

from dataclasses import fields, replace

from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions

# What a request's `registry` object may not carry: credentials travel beside it, each in its own form.
_INLINE = ("inline_credentials", "inline_identities")
_NAMES = {f.name for f in fields(RegistryOptions)} - set(_INLINE)


def for_client(asked: dict | None, credentials: tuple, identities: tuple, own: RegistryOptions, privileged: bool) -> RegistryOptions:
    """The options a request is served with. `asked`: its `registry` object; `credentials` and
    `identities`: what it sent inline (control.credentials_from_wire, identities_from_wire); `own`:
    the server's options; `privileged`: the client is root or the server's own user."""
    if asked is not None and not isinstance(asked, dict):
        raise DiskkitError("control", "registry must be an object of registry options")
    unknown = sorted(set(asked or {}) - _NAMES)
    if unknown:
        raise DiskkitError("control", f"registry options {', '.join(unknown)} are not ones a request may set")
    options = RegistryOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in asked.items()}) if asked else own
    if not privileged:
        return replace(options, authfile=None, creds=None, inline_credentials=credentials, inline_identities=identities,
                       cert_dir=own.cert_dir, signature_policy=own.signature_policy, registries_d=own.registries_d,
                       boot_test_keys=own.boot_test_keys, boot_test_gpg_keys=own.boot_test_gpg_keys)
    # A policy (and a boot-test requirement) this server was started with holds for every request that names none.
    options = replace(options, signature_policy=options.signature_policy or own.signature_policy,
                      registries_d=options.registries_d or own.registries_d,
                      boot_test_keys=options.boot_test_keys or own.boot_test_keys,
                      boot_test_gpg_keys=options.boot_test_gpg_keys or own.boot_test_gpg_keys)
    if identities:
        options = replace(options, inline_identities=identities)
    if credentials:
        return replace(options, inline_credentials=credentials)
    if options.authfile is None and options.creds is None:
        return replace(options, authfile=own.authfile, creds=own.creds)
    return options
