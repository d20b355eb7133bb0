"""What every refusal of a pull must leave: one line on stderr naming the image and the rule, a
non-zero exit, and nothing in the cache that looks pulled."""

from __future__ import annotations

from pathlib import Path


def cache_entries(cache: Path) -> dict[str, list[str]]:
    """What the cache holds, by area; `tmp`, `refs` and `disks` must be empty after any refusal."""
    out = {}
    for area in ("disks", "refs", "tmp", "partial"):
        root = cache / area
        out[area] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []
    return out


def assert_refused(result, *expected: str, cache: Path) -> str:
    assert result.code != 0, result.out
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err  # one line, naming the image and the rule
    for text in expected:
        assert text in lines[0], lines[0]
    held = cache_entries(cache)
    assert held["disks"] == [] and held["refs"] == [] and held["tmp"] == [], held
    return lines[0]
