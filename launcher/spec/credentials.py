"""spec.accessCredentials (pure): the ssh public keys KubeVirt puts on a VMI's cloud-init disk, or
writes into the guest through its agent.

Parsed and refused as pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go
(validateAccessCredentials) does. sshPublicKey with the noCloud, configDrive or qemuGuestAgent
propagation is implemented; userPassword is refused by launcher.spec.coverage before it gets here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from launcher.spec.fields import SpecError, as_list, as_map, get_str

NOCLOUD, CONFIGDRIVE, QEMU_GUEST_AGENT = "noCloud", "configDrive", "qemuGuestAgent"
# The volume kind each cloud-init propagation method writes its keys to.
VOLUME_KINDS = {NOCLOUD: "cloudInitNoCloud", CONFIGDRIVE: "cloudInitConfigDrive"}


@dataclass(frozen=True)
class SSHPublicKey:
    secret_name: str | None  # None: a source without a secret, which KubeVirt skips
    method: str  # NOCLOUD | CONFIGDRIVE | QEMU_GUEST_AGENT
    users: tuple[str, ...] = ()  # qemuGuestAgent: whose authorized_keys hold the keys


def parse(items: object, volume_kinds: Iterable[str], at: str) -> tuple[SSHPublicKey, ...]:
    kinds = set(volume_kinds)
    found = []
    for idx, item in enumerate(as_list(items, at)):
        here = f"{at}[{idx}]"
        item = as_map(item, here)
        ssh = item.get("sshPublicKey")
        if ssh is not None:
            doc = as_map(ssh, f"{here}.sshPublicKey")
            source = as_map(doc.get("source"), f"{here}.sshPublicKey.source")
            methods_doc = as_map(doc.get("propagationMethod"), f"{here}.sshPublicKey.propagationMethod")
            methods = [m for m in (NOCLOUD, CONFIGDRIVE, QEMU_GUEST_AGENT) if methods_doc.get(m) is not None]
            users: tuple[str, ...] = ()
            for method in methods:
                if method in VOLUME_KINDS and VOLUME_KINDS[method] not in kinds:
                    raise SpecError(f"{here}.sshPublicKey.propagationMethod",
                                    f"{here} requires a {method} volume to exist when the {method} propagationMethod is in use.")
                if method == QEMU_GUEST_AGENT:
                    users = _users(methods_doc[method], f"{here}.sshPublicKey.propagationMethod.qemuGuestAgent")
                    if not users:
                        raise SpecError(f"{here}.sshPublicKey.propagationMethod.qemuGuestAgent.users",
                                        f"{here} requires at least one user to be present in the users list")
            if source.get("secret") is None:
                raise SpecError(f"{here}.sshPublicKey.source", f"{here} must have exactly one source set")
            if len(methods) != 1:
                raise SpecError(f"{here}.sshPublicKey.propagationMethod", f"{here} must have exactly one propagationMethod set")
        if (ssh is not None) + (item.get("userPassword") is not None) != 1:
            raise SpecError(here, f"{here} must have exactly one access credential type set")
        if ssh is None:
            continue  # userPassword: refused by launcher.spec.coverage, or dropped with --ignore-unsupported
        secret = as_map(source["secret"], f"{here}.sshPublicKey.source.secret")
        found.append(SSHPublicKey(get_str(secret, "secretName", f"{here}.sshPublicKey.source.secret"), methods[0], users))
    return tuple(found)


def _users(doc: object, at: str) -> tuple[str, ...]:
    users = as_list(as_map(doc, at).get("users"), f"{at}.users")
    for idx, user in enumerate(users):
        if not isinstance(user, str) or not user:
            raise SpecError(f"{at}.users[{idx}]", "must be a user name")
    return tuple(users)


def public_keys(credentials: Iterable[SSHPublicKey], method: str, secrets: Mapping[str, Mapping[str, bytes]]) -> dict[str, str]:
    """The keys of one propagation method, numbered from "0" as pkg/cloud-init/cloud-init.go
    resolveSSHPublicKeys numbers them: every non-empty value of each Secret, in the order the kubelet's
    mount lists its files (by key), and the count running on across credentials. `secrets` maps a
    Secret's name to its data."""
    keys: dict[str, str] = {}
    for cred in credentials:
        if cred.method != method or not cred.secret_name:
            continue
        data = secrets[cred.secret_name]
        for name in sorted(data):
            if name.startswith("..") or not data[name]:
                continue
            keys[str(len(keys))] = data[name].decode("utf-8", "replace")
    return keys


def secret_keys(data: Mapping[str, bytes]) -> list[str]:
    """The keys of one Secret as virt-launcher's access credential manager reads its mount
    (access-credentials/access_credentials.go readKeysFromDirectory): every file but the kubelet's
    `..` entries, by name, each non-empty line trimmed."""
    keys = []
    for name in sorted(data):
        if name.startswith(".."):
            continue
        for line in data[name].decode("utf-8", "replace").split("\n"):
            if line.strip():
                keys.append(line.strip())
    return keys


def agent_keys(credentials: Iterable[SSHPublicKey], secrets: Mapping[str, Mapping[str, bytes]]) -> dict[str, list[str]]:
    """Each user's authorized keys for the qemuGuestAgent propagation (reloadCredentialFiles): the
    keys of every Secret naming the user, in the credentials' order. `secrets` maps a Secret's name to its data."""
    by_user: dict[str, list[str]] = {}
    for cred in credentials:
        if cred.method != QEMU_GUEST_AGENT or not cred.secret_name:
            continue
        for user in cred.users:
            by_user.setdefault(user, []).extend(secret_keys(secrets[cred.secret_name]))
    return by_user
