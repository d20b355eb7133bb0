"""The user an image's guest is logged in as, when the image says it: a config label, as an image
carries its instance type hints (diskkit.oci.hints). Cloud images each have their own default user
(cloud-init's `default_user`: debian, fedora, ubuntu...) and nothing in KubeVirt or OCI names it; the
label lets a publisher say it once (`diskkit build --label io.diskkit.default-user=debian`) and
`launcher test` log in without `--user`.

Pure: the label's name and its value's rule (a user name: it goes on ssh's command line as USER@HOST).
"""

from __future__ import annotations

import re

from diskkit.errors import DiskkitError

DEFAULT_USER_LABEL = "io.diskkit.default-user"
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def default_user(config: dict | None, image: str) -> str | None:
    """The label's user, None when the image has no such label; a value that is not a user name is refused."""
    labels = ((config or {}).get("config") or {}).get("Labels") or {}
    if not isinstance(labels, dict) or DEFAULT_USER_LABEL not in labels:
        return None
    value = labels[DEFAULT_USER_LABEL]
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise DiskkitError(f"{image}: label {DEFAULT_USER_LABEL}", "must be a user name (a letter or _, then letters, digits, _ . -; at most 32)")
    return value
