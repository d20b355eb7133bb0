"""`diskkit prune` (issue 32 item 4): the older matching tags go, the newest N by the config's created
time stay, and no digest that a kept tag still points at is deleted."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime, timezone

from diskkit.ops.prune import parse_created, plan
from tests.conftest import make_qcow2

INSECURE = "--tls-verify=false"


def at(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def test_plan_keeps_the_newest_by_created_time_not_by_name():
    digests = {"40-a": "sha256:a", "40-b": "sha256:b", "40-c": "sha256:c", "40": "sha256:a"}
    created = {"40-a": at(3000), "40-b": at(1000), "40-c": at(2000)}
    result = plan(digests, created, re.compile(r"40-.*"), keep=1)
    assert result.delete == {"sha256:b": ["40-b"], "sha256:c": ["40-c"]}
    assert result.keep == {"40-a": "among the newest 1"}


def test_plan_never_deletes_a_digest_a_kept_tag_points_at():
    digests = {"40-a": "sha256:a", "40-b": "sha256:b", "40-c": "sha256:c", "40-d": "sha256:c", "stable": "sha256:b", "40": "sha256:i"}
    created = {"40-a": at(4000), "40-b": at(1000), "40-c": at(2000), "40-d": at(3000), "40-e": None}
    digests["40-e"] = "sha256:e"
    digests["40-f"] = "sha256:f"
    created["40-f"] = at(500)
    result = plan(digests, created, re.compile(r"40-.*"), keep=2, children={"40": ["sha256:f"]})
    assert result.delete == {}
    assert result.keep["40-b"] == "its digest sha256:b is also tagged stable"  # a tag not matching
    assert result.keep["40-c"] == "its digest sha256:c is also tagged 40-d"  # one of the newest kept
    assert result.keep["40-e"] == "no created time in its config"
    assert result.keep["40-f"] == "its digest sha256:f is in the index tagged 40"
    # the pattern matches whole tags only: `40` is not a `4.` tag
    assert plan({"40": "sha256:x", "4x": "sha256:y"}, {"4x": at(1)}, re.compile("4."), keep=0).delete == {"sha256:y": ["4x"]}


def test_parse_created():
    assert parse_created("2026-11-25T12:00:00Z") == datetime(2026, 11, 25, 12, tzinfo=timezone.utc)
    assert parse_created("2026-11-25T12:00:00.123456789+00:00") == datetime(2026, 11, 25, 12, 0, 0, 123456, tzinfo=timezone.utc)
    assert parse_created(None) is None and parse_created("yesterday") is None


def test_prune_against_the_registry(diskkit, registry, tmp_path):
    repo = f"{registry.host}/prune-{uuid.uuid4().hex[:8]}"
    digests = {}
    # created order differs from name order: 40-b is the newest
    for pattern, (tag, epoch) in enumerate([("40-a", 1000), ("40-b", 3000), ("40-c", 2000), ("40-d", 500)], start=1):
        disk = make_qcow2(tmp_path / f"{tag}.qcow2", pattern=pattern)
        built = diskkit("build", disk, "-t", f"{repo}:{tag}", INSECURE, env={"SOURCE_DATE_EPOCH": str(epoch)})
        assert built.code == 0, built.err
        digests[tag] = built.last_line
    assert diskkit("tag", INSECURE, f"{repo}@{digests['40-b']}", "40", "latest").code == 0
    assert diskkit("tag", INSECURE, f"{repo}@{digests['40-d']}", "stable").code == 0

    dry = diskkit("prune", INSECURE, repo, "--match", r"40-.*", "--keep", "1", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    report = json.loads(dry.out)
    assert report["dry_run"] is True
    assert sorted(d["tags"][0] for d in report["delete"]) == ["40-a", "40-c"]
    assert report["keep"] == {"40-b": "among the newest 1", "40-d": f"its digest {digests['40-d']} is also tagged stable"}
    assert sorted(diskkit("tags", INSECURE, repo).out.split()) == ["40", "40-a", "40-b", "40-c", "40-d", "latest", "stable"]

    done = diskkit("prune", INSECURE, repo, "--match", r"40-.*", "--keep", "1")
    assert done.code == 0, done.err
    assert f"deleted {digests['40-a']} (40-a)" in done.out and f"deleted {digests['40-c']} (40-c)" in done.out
    assert sorted(diskkit("tags", INSECURE, repo).out.split()) == ["40", "40-b", "40-d", "latest", "stable"]
    for tag in ("latest", "stable"):
        assert diskkit("verify", INSECURE, f"{repo}:{tag}").code == 0


def test_prune_refuses_a_bad_pattern_and_a_tagged_repository(diskkit, registry):
    bad = diskkit("prune", INSECURE, f"{registry.host}/x", "--match", "40-(", "--keep", "1")
    assert bad.code != 0 and "--match 40-(: not a regular expression" in bad.err
    tagged = diskkit("prune", INSECURE, f"{registry.host}/x:v1", "--match", "40-.*", "--keep", "1")
    assert tagged.code != 0 and "without a tag or digest" in tagged.err
