"""Published checksums: `--checksum sha256:HEX` and the checksum files upstreams put beside their
images, in GNU coreutils' format (`HEX  name`, `HEX *name` for binary mode) and BSD's tagged one
(`SHA256 (name) = HEX`), as kubevirt/containerdisks pkg/hashsum/hashsum.go reads them. Pure: text
in, (algorithm, hex) pairs out; and a hasher for every algorithm asked for."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from diskkit.errors import DiskkitError

FILE_LIMIT = 4 << 20  # a checksum file is a few lines; anything bigger is no checksum file

ALGORITHMS = {"sha256": 64, "sha512": 128}  # hex digits of each digest
_BSD = re.compile(r"^(SHA256|SHA512) ?\((?P<name>.+)\) ?= ?(?P<hex>[0-9a-fA-F]+)$")
_GNU = re.compile(r"^(?P<hex>[0-9a-fA-F]+) [ *](?P<name>.+)$")


@dataclass(frozen=True)
class Expected:
    algorithm: str
    hex: str
    origin: str  # where the value came from, for the refusal: --checksum, or the checksum file

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hex}"


def parse_value(value: str) -> Expected:
    """`sha256:HEX` or `sha512:HEX`, as --checksum takes it."""
    algorithm, sep, digest = value.partition(":")
    algorithm = algorithm.lower()
    if not sep or algorithm not in ALGORITHMS:
        raise DiskkitError(f"--checksum {value}", "must be sha256:HEX or sha512:HEX")
    digest = digest.lower()
    if len(digest) != ALGORITHMS[algorithm] or not re.fullmatch(r"[0-9a-f]+", digest):
        raise DiskkitError(f"--checksum {value}", f"a {algorithm} digest is {ALGORITHMS[algorithm]} hex digits")
    return Expected(algorithm, digest, "--checksum")


def parse_file(text: str) -> list[tuple[str, str, str]]:
    """Every (name, algorithm, hex) entry of a GNU or BSD checksum file. Lines that are neither (a PGP
    armour around a signed file, `# comments`, blank lines) are skipped, as sha256sum -c skips them;
    a GNU entry's algorithm is told by its length."""
    entries = []
    for line in text.splitlines():
        line = line.strip()
        if match := _BSD.match(line):
            algorithm = match.group(1).lower()
            name, digest = match.group("name"), match.group("hex").lower()
        elif match := _GNU.match(line):
            name, digest = match.group("name"), match.group("hex").lower()
            algorithm = next((a for a, n in ALGORITHMS.items() if n == len(digest)), "")
        else:
            continue
        if algorithm and len(digest) == ALGORITHMS[algorithm]:
            entries.append((name, algorithm, digest))
    return entries


def lookup(text: str, name: str, origin: str) -> list[Expected]:
    """The entries for file `name` (compared by base name, so `./x` and `dir/x` count as `x`); a name
    the file lists with two different digests of one algorithm is refused, as is one it lacks."""
    found: dict[str, str] = {}
    for entry, algorithm, digest in parse_file(text):
        if entry.rsplit("/", 1)[-1] != name:
            continue
        if found.setdefault(algorithm, digest) != digest:
            raise DiskkitError(origin, f"lists {name} twice with different {algorithm} digests; refused")
    if not found:
        known = len(parse_file(text))
        raise DiskkitError(origin, f"has no sha256 or sha512 entry for {name} ({known} entries in GNU or BSD format)")
    return [Expected(a, d, origin) for a, d in sorted(found.items())]


class Hashes:
    """Every algorithm the expectations name, fed the same bytes."""

    def __init__(self, expected: list[Expected]):
        self.expected = expected
        self._hashes = {e.algorithm: hashlib.new(e.algorithm) for e in expected}

    def update(self, data) -> None:
        for h in self._hashes.values():
            h.update(data)

    def mismatch(self) -> tuple[Expected, str] | None:
        """The first expectation the bytes fail, with what they hash to; None when all hold."""
        for e in self.expected:
            actual = self._hashes[e.algorithm].hexdigest()
            if actual != e.hex:
                return e, f"{e.algorithm}:{actual}"
        return None
