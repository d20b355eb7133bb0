"""Boot-test attestations through the OCI 1.1 referrers API (diskkit/signing/referrers.py).

The distribution registry here (2.8) has no referrers API, so test_attestation.py exercises the
referrers tag schema. This emulates a registry WITH the API in front of the real one
(tests/faultproxy.py), in distribution-spec 1.1's words (spec.md):
- "Pushing Manifests with Subject": a registry that supports the referrers API "MUST respond with
  the response header `OCI-Subject: <subject digest>`" to a manifest PUT with a `subject`; the
  manifest itself is stored in the real registry, the emulation keeps the descriptor it saw.
- "Listing Referrers": GET /v2/<name>/referrers/<digest> answers 200 with an image index,
  `Content-Type: application/vnd.oci.image.index.v1+json`, each descriptor with the manifest's
  `artifactType` (else its config's mediaType) and its annotations; an empty list when none.
With the API, attach lists nothing under the `sha256-<hex>` tag and verify-attestation reads the API.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading

import pytest
import requests

from diskkit.ops.attest import Attester
from diskkit.signing import attestation as at
from diskkit.signing.options import SignOptions
from tests.faultproxy import FaultProxy
from tests.test_attestation import PLAIN, build, keys, predicate, refusal, verify  # noqa: F401 (fixture)

INDEX = "application/vnd.oci.image.index.v1+json"
_REFERRERS = re.compile(r"^/v2/(.+)/referrers/(sha256:[0-9a-f]{64})$")
_MANIFEST = re.compile(r"^/v2/(.+)/manifests/([^/]+)$")


class ReferrersAPI:
    """The referrers API over the real registry at `upstream` (its base URL): manifest PUTs are
    stored there, and those with a subject also listed here."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.listed: dict[tuple[str, str], list[dict]] = {}
        self.lock = threading.Lock()

    def __call__(self, method: str, target: str, read_body):
        path = target.split("?", 1)[0]
        if method == "GET" and (match := _REFERRERS.match(path)):
            with self.lock:
                manifests = list(self.listed.get(match.groups(), []))
            return 200, {"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}, {"Content-Type": INDEX}
        if method != "PUT" or not (match := _MANIFEST.match(path)):
            return None
        repository, reference = match.groups()
        data = read_body()
        doc = json.loads(data)
        stored = requests.put(f"{self.upstream}/v2/{repository}/manifests/{reference}", data=data,
                              headers={"Content-Type": doc["mediaType"]}, timeout=60)
        headers = {k: stored.headers[k] for k in ("Location", "Docker-Content-Digest") if k in stored.headers}
        subject = doc.get("subject")
        if stored.status_code == 201 and isinstance(subject, dict):
            entry = {"mediaType": doc["mediaType"], "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data),
                     "artifactType": doc.get("artifactType") or doc["config"]["mediaType"]}
            if doc.get("annotations"):
                entry["annotations"] = doc["annotations"]
            with self.lock:
                entries = self.listed.setdefault((repository, subject["digest"]), [])
                if entry["digest"] not in [e["digest"] for e in entries]:
                    entries.append(entry)
            headers["OCI-Subject"] = subject["digest"]
        return stored.status_code, stored.json() if stored.content else {}, headers


@pytest.fixture
def api_registry(registry):
    api = ReferrersAPI(registry.url("").rstrip("/"))
    with FaultProxy(registry.host) as proxy:
        proxy.answer = api
        yield proxy, api


class _At:
    """A registry fixture's shape (host) for test_attestation's helpers."""

    def __init__(self, host: str):
        self.host = host


def test_attach_and_verify_use_the_referrers_api_and_no_fallback_tag(registry, api_registry, keys, tmp_path):
    proxy, api = api_registry
    ref, digest = build(_At(proxy.host), tmp_path, "referrers/api", 0x31)
    tag_path = f"/v2/referrers/api/manifests/sha256-{digest[7:]}"
    # none yet: the API's empty list, not the tag's 404, is what says so
    line = refusal(verify(ref, "--key", keys["dir"] / "b.pub"))
    assert line == f"diskkit: {ref}: no attestation refers to {digest}", line

    first = Attester(SignOptions(keys["dir"] / "b.private", keys["pass"])).attach(ref, digest, predicate(ref, digest), PLAIN)
    second = Attester(SignOptions(None, sign_by=keys["g"])).attach(ref, digest, predicate(ref, digest), PLAIN)
    assert first["listedBy"] == second["listedBy"] == "referrers API"
    listed = api.listed[("referrers/api", digest)]
    assert [e["digest"] for e in listed] == [first["referrer"].split("@")[1], second["referrer"].split("@")[1]]
    assert [e["artifactType"] for e in listed] == [at.BUNDLE_MEDIA_TYPE, at.DSSE_MEDIA_TYPE]
    # the referrers were stored in the real registry; nothing was put or read under the fallback tag
    for entry in listed:
        assert requests.get(registry.url(f"/v2/referrers/api/manifests/{entry['digest']}"), headers={"Accept": entry["mediaType"]}).status_code == 200
    assert requests.get(registry.url(tag_path), headers={"Accept": INDEX}).status_code == 404
    assert not any(p == tag_path for _, p, _ in proxy.log), proxy.log

    proxy.log.clear()
    ok = verify(ref, "--key", keys["dir"] / "b.pub")
    assert ok.code == 0, ok.err
    assert ok.out.startswith(f"OK {ref}: {digest} boot-tested (pass"), ok.out
    assert verify(ref, "--gpg-key", keys["dir"] / "g.gpg").code == 0
    assert ("GET", f"/v2/referrers/api/referrers/{digest}") in [(m, p) for m, p, _ in proxy.log]
    assert not any(p == tag_path for _, p, _ in proxy.log), proxy.log
    # the same image read from the registry behind, which has no API and no tag: nothing refers to it
    direct = f"{registry.host}/referrers/api@{digest}"
    assert refusal(verify(direct, "--key", keys["dir"] / "b.pub")) == f"diskkit: {direct}: no attestation refers to {digest}"
