"""Boot-read traces on the disk server's side: a trace signed by a key in force, published as an OCI
1.1 referrer of the image (the referrers tag schema: distribution 2.8 has no referrers API), decides
what a lazy export prefetches first; one that no trusted key signed, that is another image's, names
bytes outside the disk or is too large is refused, and the export prefetches as it would without.
Real registry, a fault proxy in front of it for its request log, a real `launcher serve`; no guest
(tests/test_attestation.py records a trace from a real lazy boot)."""

from __future__ import annotations

import base64
import json
import time

import pytest
import requests

from diskkit.layers import lazytoc
from diskkit.oci import readtrace
from diskkit.oci.image import Descriptor
from diskkit.oci.reference import parse_docker_name
from diskkit.ops.attest import Attester
from diskkit.registry.options import RegistryOptions
from diskkit.signing import attestation as at
from diskkit.signing import referrers
from diskkit.signing.options import SignOptions
from launcher.diskserver.lazydisk import HEAD_PREFETCH
from tests.conftest import run_diskkit, sigstore_keys
from tests.lazyhost import disk_server, export_status, image_toc, open_export, random_disk, wait_for

MIB = 1 << 20
PLAIN = RegistryOptions(tls_verify=False)
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    """Cosign-format keys: a is the node's trusted key, b is not."""
    d = tmp_path_factory.mktemp("trace-keys")
    sigstore_keys(d, "open sesame")
    return {name: Attester(SignOptions(d / f"{name}.private", d / "pass")) for name in ("a", "b")} | {"dir": d}


def lazy_image(registry, tmp_path, repo: str, size: int, seed: int) -> tuple[str, str, dict]:
    """(ref, manifest digest, TOC) of a lazy image of a random disk."""
    disk = random_disk(tmp_path / f"{repo.replace('/', '-')}.img", size, seed)
    ref = f"{registry.host}/{repo}:v1"
    r = run_diskkit("build", "--tls-verify=false", "--lazy", disk, "-t", ref)
    assert r.code == 0, r.err
    return ref, r.last_line, image_toc(registry, ref)


def boot_tested(keys, ref: str, digest: str) -> None:
    """A passed boot-test attestation by key a: what the server's --require-boot-test-key asks before an open."""
    keys["a"].attach(ref, digest, at.boot_test_predicate(ref, digest, "echo hello", 1.0, True, 0, "", "test", "2026-01-01T00:00:00Z"), PLAIN)


def trace_predicate(ref: str, digest: str, toc: dict, reads: list) -> dict:
    return readtrace.predicate(ref, digest, toc["disk"], toc["size"], reads, False, "test", "2026-01-01T00:00:00Z")


def chunks_asked(proxy, toc: dict) -> list[list[int]]:
    """The disk chunks each range request to the registry covered, in the order they were asked
    (the TOC's and the blob's other ranges cover none)."""
    members = toc["members"]
    out = []
    for target, value in list(proxy.ranges):
        if "/blobs/" not in target:
            continue
        first, last = (int(v) for v in value.removeprefix("bytes=").split("-"))
        covered = [i for i, (offset, length) in enumerate(members) if first <= offset and offset + length - 1 <= last]
        if covered:
            out.append(covered)
    return out


def test_a_lazy_export_prefetches_in_the_order_of_a_trusted_trace(registry, keys, fault_proxy, tmp_path):
    size = 96 * MIB
    ref, digest, toc = lazy_image(registry, tmp_path, "trace/order", size, seed=11)
    grid = lazytoc.Grid(toc["size"], toc["chunkSize"], tuple(toc[lazytoc.LENGTHS_FIELD]))
    head_end = grid.past(0, HEAD_PREFETCH)  # what a booting VM's export prefetches anyway
    # A boot that read far past the head, out of the disk's order: without the trace these chunks
    # wait for the boot hold to end and then come in ascending order.
    reads = [[80 * MIB, 65536], [44 * MIB, 65536], [70 * MIB + 4096, 512], [50 * MIB, 65536], [88 * MIB, 300 << 10]]
    order = list(dict.fromkeys(i for off, n in reads for i in range(grid.index(off), grid.index(off + n - 1) + 1)))
    assert min(order) >= head_end and order != sorted(order)
    boot_tested(keys, ref, digest)
    pushed = keys["a"].attach(ref, digest, trace_predicate(ref, digest, toc, reads), PLAIN, readtrace.PREDICATE_TYPE)
    assert pushed["listedBy"] == f"tag sha256-{digest[7:]}"

    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    # One prefetcher, so the registry sees the order it fetches in; the boot-test key is the key in force.
    with disk_server(cache, "--prefetch-threads", "1", "--require-boot-test-key", keys["dir"] / "a.pub"):
        answer = open_export(cache, ref.replace(registry.host, proxy.host))
        trace = wait_for(lambda: export_status(cache, answer["export"])["trace"], 60, "the trace lookup")
        assert trace["referrer"] == pushed["referrer"].replace(registry.host, proxy.host), trace
        assert (trace["reads"], trace["chunks"], trace["signer"]) == (len(reads), len(order), str(keys["dir"] / "a.pub")), trace
        wait_for(lambda: set(order) <= {i for asked in chunks_asked(proxy, toc) for i in asked}, 60, "the trace's chunks")
        asked = chunks_asked(proxy, toc)
    at_request = [next(n for n, covered in enumerate(asked) if i in covered) for i in order]
    assert at_request == sorted(at_request), (order, asked)  # in the trace's order
    before = [i for covered in asked[: at_request[-1]] for i in covered]
    assert all(i < head_end or i in order for i in before), (order, asked)  # and before the rest of the disk


def referrer_of(registry, keys, ref: str, digest: str, attester: str, predicate: dict, subject: str | None = None) -> str:
    """A signed trace statement about `subject` (default: `digest`), pushed as a referrer of `ref`@`digest`
    the way any pusher (or a lying registry) can: the subject of the manifest and the statement's apart."""
    name = parse_docker_name(ref, "ref")
    payload = at.statement(f"{name.registry}/{name.repository}", subject or digest, predicate, readtrace.PREDICATE_TYPE)
    env = at.envelope(payload, "", keys[attester].sign(at.pae(at.PAYLOAD_TYPE, payload)))
    return stored_referrer(registry, ref, digest, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"))


def stored_referrer(registry, ref: str, digest: str, blob: bytes) -> str:
    name = parse_docker_name(ref, "ref")
    data = requests.get(registry.url(f"/v2/{name.repository}/manifests/{digest}"), headers={"Accept": MANIFEST}).content
    desc, _ = referrers.push_referrer(name, Descriptor(MANIFEST, digest, len(data)), at.BUNDLE_MEDIA_TYPE, blob,
                                      {at.PREDICATE_ANNOTATION: readtrace.PREDICATE_TYPE}, PLAIN)
    return desc.digest


def untrusted(registry, keys, ref, digest, toc, tmp_path):
    referrer_of(registry, keys, ref, digest, "b", trace_predicate(ref, digest, toc, [[0, 4096]]))
    return "the signature does not verify with the given keys", None


def unsigned(registry, keys, ref, digest, toc, tmp_path):
    payload = at.statement("x/y", digest, trace_predicate(ref, digest, toc, [[0, 4096]]), readtrace.PREDICATE_TYPE)
    env = at.envelope(payload, "", b"")
    env["signatures"] = []
    stored_referrer(registry, ref, digest, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"))
    return "the envelope has no signatures", None


def forged(registry, keys, ref, digest, toc, tmp_path):
    """Key a's signature over one trace, under a payload that says other reads."""
    good = at.statement("x/y", digest, trace_predicate(ref, digest, toc, [[0, 4096]]), readtrace.PREDICATE_TYPE)
    env = at.envelope(good, "", keys["a"].sign(at.pae(at.PAYLOAD_TYPE, good)))
    env["payload"] = base64.b64encode(good.replace(b"[[0,4096]]", b"[[4096,4096]]")).decode()
    assert env["payload"] != base64.b64encode(good).decode()
    stored_referrer(registry, ref, digest, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"))
    return "the signature does not verify with the given keys", None


def another_images(registry, keys, ref, digest, toc, tmp_path):
    """A genuine trace of another image, signed by the trusted key, served as this one's by the registry."""
    other_ref, other, other_toc = lazy_image(registry, tmp_path, "trace/other", 4 * MIB, seed=31)
    referrer_of(registry, keys, ref, digest, "a", trace_predicate(other_ref, other, other_toc, [[0, 4096]]), subject=other)
    return f"the statement's subject is not {digest}", None


def another_disk(registry, keys, ref, digest, toc, tmp_path):
    predicate = trace_predicate(ref, digest, toc, [[0, 4096]])
    predicate["disk"]["size"] *= 2
    referrer_of(registry, keys, ref, digest, "a", predicate)
    return f"not {toc['disk']!r} of {toc['size']} bytes", None


def outside_the_disk(registry, keys, ref, digest, toc, tmp_path):
    referrer_of(registry, keys, ref, digest, "a", trace_predicate(ref, digest, toc, [[0, 4096], [toc["size"] - 4096, 8192]]))
    return "reads[1] [", None


def too_many_reads(registry, keys, ref, digest, toc, tmp_path):
    reads = [[i * 2, 1] for i in range(readtrace.MAX_TRACE_READS + 1)]
    referrer_of(registry, keys, ref, digest, "a", trace_predicate(ref, digest, toc, reads))
    return f"more than {readtrace.MAX_TRACE_READS}", None


def oversized(registry, keys, ref, digest, toc, tmp_path):
    """3 MiB of trace, never fetched."""
    blob = b"{" + b" " * (3 * MIB) + b"}"
    stored_referrer(registry, ref, digest, blob)
    from diskkit.oci.image import sha256_digest

    return f"attestation of {len(blob)} bytes, larger than", sha256_digest(blob)


@pytest.mark.parametrize("case", [untrusted, unsigned, forged, another_images, another_disk, outside_the_disk, too_many_reads, oversized],
                         ids=lambda case: case.__name__)
def test_a_trace_no_trusted_key_vouches_for_is_refused_and_prefetch_goes_on_without(case, registry, keys, fault_proxy, tmp_path):
    ref, digest, toc = lazy_image(registry, tmp_path, f"trace/{case.__name__.replace('_', '-')}", 4 * MIB, seed=21)
    boot_tested(keys, ref, digest)
    why, unread = case(registry, keys, ref, digest, toc, tmp_path)
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--require-boot-test-key", keys["dir"] / "a.pub"):
        answer = open_export(cache, ref.replace(registry.host, proxy.host))
        trace = wait_for(lambda: export_status(cache, answer["export"])["trace"], 60, "the trace lookup")
        assert set(trace) == {"refused"} and why in trace["refused"], trace
        # The export goes on as it would have: the whole disk arrives, checked against its TOC.
        wait_for(lambda: export_status(cache, answer["export"])["verified"], 120, "the whole disk")
    if unread is not None:
        assert not any(unread in path for path in proxy.sent), proxy.sent


def test_with_no_key_in_force_no_trace_is_looked_for(registry, keys, fault_proxy, tmp_path):
    """No keys, no referrers request: a node that trusts no one asks nothing."""
    ref, digest, toc = lazy_image(registry, tmp_path, "trace/nokey", 4 * MIB, seed=41)
    keys["a"].attach(ref, digest, trace_predicate(ref, digest, toc, [[0, 4096]]), PLAIN, readtrace.PREDICATE_TYPE)
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = open_export(cache, ref.replace(registry.host, proxy.host))
        wait_for(lambda: export_status(cache, answer["export"])["verified"], 120, "the whole disk")
        assert export_status(cache, answer["export"])["trace"] is None
    assert not any("/referrers/" in path or "/manifests/sha256-" in path for _, path, _ in proxy.log), proxy.log
