"""What an http(s) source argument is: whether it is a URL at all, the file name its path ends in,
and how it may be printed (without credentials or query). Pure string work, so a command given a
local file decides so without loading the HTTP client."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from diskkit.errors import DiskkitError


def is_url(spec: str) -> bool:
    return spec.partition("://")[1] != "" and spec.partition("://")[0].isalpha()


def shown(url: str) -> str:
    """The URL as it may be printed: without `user:pass@` or the query, where tokens live."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def file_name(url: str) -> str:
    """The file name a URL's path ends in (what a checksum file lists), or "" for none."""
    name = unquote(urlsplit(url).path).rsplit("/", 1)[-1]
    return "" if name in ("", ".", "..") else name


def check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DiskkitError(shown(url), "only http:// and https:// URLs are read; download it first and give the file")
