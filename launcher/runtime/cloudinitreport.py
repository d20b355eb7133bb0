"""What cloud-init tells on a guest's serial console about ssh, read line by line (pure: bytes in).

At first boot cloud-init prints (cloudinit/config/cc_keys_to_console.py, its helper
tools/write-ssh-key-fingerprints) the guest's new host keys between `-----BEGIN SSH HOST KEY KEYS-----`
and `-----END SSH HOST KEY KEYS-----`, and (cc_ssh_authkey_fingerprints.py) a table of the keys it
installed, `Authorized keys from PATH for user NAME`, one row per key with its sha256 fingerprint in
colon-separated hex. Its stages start with `Cloud-init v. VERSION running '<stage>'` and the last one
ends with `Cloud-init v. VERSION finished at ...` (cmd/main.py), so a reader knows whether cloud-init
runs at all and when nothing more will come.

Only the first complete host key block counts: a guest that prints a second one later (a reboot, or a
program writing to the console) cannot change what was learned. Each key must be a well-formed key of
the type it names; lines, keys and tables are bounded so a guest printing without end cannot grow our memory.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass, field

BEGIN_KEYS = "-----BEGIN SSH HOST KEY KEYS-----"
END_KEYS = "-----END SSH HOST KEY KEYS-----"
LINE_MAX = 1 << 14  # a host key line is under 1 KiB (RSA 4096: ~740 bytes)
KEYS_MAX = 16
USERS_MAX = 64
KEY_TYPES = ("ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-dss",
             "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")

_KEY = re.compile(r"(?:^|\s)(" + "|".join(re.escape(t) for t in KEY_TYPES) + r") ([A-Za-z0-9+/]+={0,2})(?:\s|$)")
_RUNNING = re.compile(r"Cloud-init v\. \S+ running '")
_FINISHED = re.compile(r"Cloud-init v\. \S+ finished at ")
_TABLE = re.compile(r"Authorized keys from \S+ for user ([a-z_][a-z0-9_.-]{0,31})\b")
_FINGERPRINT = re.compile(r"\b([0-9a-f]{2}(?::[0-9a-f]{2}){31})\b")


@dataclass(frozen=True)
class HostKey:
    type: str
    key: str  # base64, as in known_hosts


def parse_key(type_: str, b64: str) -> HostKey | None:
    """A host key, if `b64` holds an ssh public key blob of `type_` (the blob names its own type first)."""
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(blob) < 4:
        return None
    (length,) = struct.unpack(">I", blob[:4])
    if blob[4:4 + length] != type_.encode() or len(blob) <= 4 + length:
        return None
    return HostKey(type_, b64)


def fingerprint(public_key: str) -> str | None:
    """cloud-init's sha256 fingerprint of an authorized key line (`TYPE BASE64 [COMMENT]`): colon-separated hex."""
    parts = public_key.split()
    if len(parts) < 2:
        return None
    try:
        digest = hashlib.sha256(base64.b64decode(parts[1], validate=True)).hexdigest()
    except (binascii.Error, ValueError):
        return None
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


@dataclass
class Report:
    """Feed it the console as it streams; it keeps what cloud-init said about ssh."""

    cloud_init: bool = False  # a cloud-init stage started
    finished: bool = False  # cloud-init's last stage ended
    host_keys: tuple[HostKey, ...] | None = None  # the first complete block
    users: dict[str, str] = field(default_factory=dict)  # authorized key fingerprint -> the user it was installed for
    _block: list[HostKey] | None = None
    _user: str | None = None
    _partial: bytes = b""

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        self._partial = self._partial[:LINE_MAX]
        for line in lines:
            self._line(line[:LINE_MAX].decode("utf-8", "replace").rstrip("\r"))

    def _line(self, line: str) -> None:
        if _RUNNING.search(line):
            self.cloud_init = True
        elif _FINISHED.search(line):
            self.cloud_init = self.finished = True
        if self.host_keys is None:
            self._keys_line(line)
        if m := _TABLE.search(line):
            self._user = m.group(1)
        elif self._user is not None and line.lstrip().startswith("ci-info:") and len(self.users) < USERS_MAX:
            if m := _FINGERPRINT.search(line):
                self.users.setdefault(m.group(1), self._user)
        else:
            self._user = None

    def _keys_line(self, line: str) -> None:
        if BEGIN_KEYS in line:
            self._block = []
        elif self._block is None:
            return
        elif END_KEYS in line:
            if self._block:
                self.host_keys = tuple(self._block)
            self._block = None
        elif (m := _KEY.search(line)) and len(self._block) < KEYS_MAX:
            key = parse_key(m.group(1), m.group(2))
            if key is not None and key not in self._block:
                self._block.append(key)

    def user_of(self, public_key: str) -> str | None:
        """The user cloud-init installed `public_key` for, as its fingerprint table says."""
        fp = fingerprint(public_key)
        return self.users.get(fp) if fp else None

    def verdict(self) -> str:
        """Once the guest's sshd answers: "keys" (learned from the console), "wait" (cloud-init is still
        running and has not printed them yet) or "first-use" (no cloud-init, or it ended without keys)."""
        if self.host_keys:
            return "keys"
        if self.cloud_init and not self.finished:
            return "wait"
        return "first-use"
