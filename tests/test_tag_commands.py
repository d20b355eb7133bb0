"""Tags as first-class (issue 32 item 4): list a repository's tags page by page, put a manifest under
more tags, and a delete that refuses to take other tags along with the digest it removes."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
import urllib.request
import uuid

import pytest

from diskkit.errors import DiskkitError
from diskkit.ops.tags import list_tags, next_page, open_repo, repository_only
from diskkit.registry.options import RegistryOptions
from tests.conftest import make_qcow2, run
from tests.faultproxy import Fault

INSECURE = "--tls-verify=false"


def new_repo(registry) -> str:
    return f"{registry.host}/tags-{uuid.uuid4().hex[:8]}"


def skopeo_digest(ref: str, *flags: str) -> str:
    return json.loads(run("skopeo", "inspect", "--tls-verify=false", *flags, f"docker://{ref}").stdout)["Digest"]


@pytest.fixture
def image(diskkit, registry, qcow2):
    """A repository with one image under tag `v1`: (repository, digest)."""
    repo = new_repo(registry)
    built = diskkit("build", qcow2, "-t", f"{repo}:v1", INSECURE)
    assert built.code == 0, built.err
    return repo, built.last_line


def test_tag_puts_the_same_manifest_under_each_new_tag(diskkit, image):
    repo, digest = image
    result = diskkit("tag", INSECURE, "--json", f"{repo}@{digest}", "40", "latest")
    assert result.code == 0, result.err
    assert json.loads(result.out) == {"source": f"{repo}@{digest}", "digest": digest, "tags": ["40", "latest"]}
    # skopeo, reading the registry on its own, sees the source's digest under every new tag
    for tag in ("v1", "40", "latest"):
        assert skopeo_digest(f"{repo}:{tag}") == digest
    by_tag = diskkit("tag", INSECURE, f"{repo}:40", "again")
    assert by_tag.code == 0 and by_tag.last_line == digest
    assert skopeo_digest(f"{repo}:again") == digest


def test_tag_keeps_an_index_whole(diskkit, registry, tmp_path):
    repo = new_repo(registry)
    x86, arm = make_qcow2(tmp_path / "x86.qcow2"), make_qcow2(tmp_path / "arm.qcow2", pattern=2)
    built = diskkit("build", "--platform", f"linux/amd64={x86}", "--platform", f"linux/arm64={arm}", "-t", f"{repo}:multi", INSECURE)
    assert built.code == 0, built.err
    assert diskkit("tag", INSECURE, f"{repo}:multi", "copy").code == 0
    raw = json.loads(run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{repo}:copy").stdout)
    assert [m["platform"]["architecture"] for m in raw["manifests"]] == ["amd64", "arm64"]
    assert skopeo_digest(f"{repo}:copy", "--override-arch", "arm64") == skopeo_digest(f"{repo}:multi", "--override-arch", "arm64")


def test_tag_refusals(diskkit, image):
    repo, digest = image
    bad = diskkit("tag", INSECURE, f"{repo}@{digest}", "no/slash")
    assert bad.code != 0 and "no/slash: not a valid tag" in bad.err and len(bad.err.strip().splitlines()) == 1
    missing = diskkit("tag", INSECURE, f"{repo}:nothere", "x")
    assert missing.code != 0 and f"{repo}:nothere: no such tag" in missing.err
    assert diskkit("tags", INSECURE, repo).out.split() == ["v1"]


def test_tags_lists_every_tag_as_text_and_json(diskkit, image):
    repo, digest = image
    assert diskkit("tag", INSECURE, f"{repo}@{digest}", "a", "b").code == 0
    text = diskkit("tags", INSECURE, f"docker://{repo}")
    assert text.code == 0, text.err
    assert sorted(text.out.split()) == ["a", "b", "v1"]
    as_json = json.loads(diskkit("tags", INSECURE, "--json", repo).out)
    assert as_json["Repository"] == repo and sorted(as_json["Tags"]) == ["a", "b", "v1"]
    # skopeo list-tags prints the same object
    assert as_json == json.loads(run("skopeo", "list-tags", "--tls-verify=false", f"docker://{repo}").stdout)


def test_tags_refuses_a_tag_and_names_a_missing_repository(diskkit, registry):
    with_tag = diskkit("tags", INSECURE, f"{registry.host}/some/repo:v1")
    assert with_tag.code != 0 and "without a tag or digest" in with_tag.err
    missing = diskkit("tags", INSECURE, f"{registry.host}/never-pushed-{uuid.uuid4().hex[:6]}")
    assert missing.code != 0 and "no such repository" in missing.err


class _Paginator(http.server.BaseHTTPRequestHandler):
    """In front of the real registry, whose 2.8 tag list ignores `n`: pages the real list as
    distribution 3 and the big registries do (`n`, `last`, a Link to the next page)."""

    upstream = ""
    asked: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).asked.append(self.path)
        url = urllib.parse.urlsplit(self.path)
        upstream = json.loads(urllib.request.urlopen(f"http://{self.upstream}{url.path}").read())
        if not url.path.endswith("/tags/list"):  # the /v2/ ping
            upstream["tags"] = []
        query = dict(urllib.parse.parse_qsl(url.query))
        tags = sorted(upstream["tags"])
        if "last" in query:
            tags = [tag for tag in tags if tag > query["last"]]
        n = int(query.get("n", len(tags)))
        page, more = tags[:n], len(tags) > n
        body = json.dumps({"name": upstream.get("name"), "tags": page} if "name" in upstream else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if more:
            self.send_header("Link", f'<{url.path}?n={n}&last={page[-1]}>; rel="next"')
        self.end_headers()
        self.wfile.write(body)


def test_tags_follows_the_link_header_page_by_page(diskkit, image, registry):
    repo, digest = image
    assert diskkit("tag", INSECURE, f"{repo}@{digest}", "t1", "t2", "t3", "t4").code == 0
    _Paginator.upstream, _Paginator.asked = registry.host, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Paginator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        name = repository_only(repo.replace(registry.host, f"127.0.0.1:{server.server_address[1]}"))
        listed = list_tags(open_repo(name, RegistryOptions(tls_verify=False), "pull"), page=2)
    finally:
        server.shutdown()
        server.server_close()
    assert listed == ["t1", "t2", "t3", "t4", "v1"]
    pages = [path for path in _Paginator.asked if "/tags/list" in path]
    assert pages[0].endswith("?n=2") and len(pages) == 3 and "last=t2" in pages[1] and "last=t4" in pages[2]


def test_tags_through_basic_auth(diskkit, auth_registry, qcow2):
    repo = new_repo(auth_registry)
    creds = f"--creds={auth_registry.username}:{auth_registry.password}"
    assert diskkit("build", qcow2, "-t", f"{repo}:v1", INSECURE, creds).code == 0
    listed = diskkit("tags", INSECURE, creds, repo)
    assert listed.code == 0 and listed.out.split() == ["v1"], listed.err
    denied = diskkit("tags", INSECURE, "--creds=nobody:wrong", repo)
    assert denied.code != 0 and "denied" in denied.err


def test_next_page_keeps_only_the_path_of_the_link():
    assert next_page('</v2/r/tags/list?last=b&n=2>; rel="next"') == "/v2/r/tags/list?last=b&n=2"
    # another host in the Link is not followed: only its path, on the registry asked
    assert next_page('<https://elsewhere.example/v2/r/tags/list?last=b>; rel="next"') == "/v2/r/tags/list?last=b"
    assert next_page(None) is None and next_page('</v2/r/tags/list>; rel="prev"') is None
    with pytest.raises(DiskkitError, match="not a /v2/ API path"):
        next_page('</token?x=1>; rel="next"')


def test_delete_refuses_while_other_tags_share_the_digest(diskkit, image):
    repo, digest = image
    assert diskkit("tag", INSECURE, f"{repo}@{digest}", "40", "latest").code == 0
    refused = diskkit("delete", INSECURE, f"{repo}:v1")
    assert refused.code != 0
    assert f"{repo}:v1: {digest} is also tagged 40, latest" in refused.err and "--force" in refused.err
    assert len(refused.err.strip().splitlines()) == 1
    assert sorted(diskkit("tags", INSECURE, repo).out.split()) == ["40", "latest", "v1"]  # nothing deleted
    forced = diskkit("delete", INSECURE, "--force", "--json", f"{repo}:v1")
    assert forced.code == 0, forced.err
    assert json.loads(forced.out) == {"reference": f"{repo}:v1", "digest": digest, "deleted": True, "tags_removed": ["40", "latest", "v1"]}
    gone = diskkit("inspect", INSECURE, f"{repo}:latest")
    assert gone.code != 0


def test_delete_of_a_tag_alone_on_its_digest(diskkit, image, tmp_path):
    repo, digest = image
    other = diskkit("build", make_qcow2(tmp_path / "b.qcow2", pattern=3), "-t", f"{repo}:keep", INSECURE)
    assert other.code == 0 and other.last_line != digest
    result = diskkit("delete", INSECURE, f"docker://{repo}:v1")
    assert result.code == 0, result.err
    assert result.last_line == digest
    assert diskkit("tags", INSECURE, repo).out.split() == ["keep"]


def test_delete_of_a_missing_tag(diskkit, image):
    repo, _ = image
    missing = diskkit("delete", INSECURE, f"{repo}:nothere")
    assert missing.code != 0
    assert missing.err.strip() == f"diskkit: {repo}:nothere: no such tag"
    ignored = diskkit("delete", INSECURE, "--ignore-missing", f"{repo}:nothere")
    assert ignored.code == 0 and ignored.out.strip() == f"{repo}:nothere: no such tag; nothing deleted"
    as_json = diskkit("delete", INSECURE, "--ignore-missing", "--json", f"{repo}:nothere")
    assert as_json.code == 0 and json.loads(as_json.out) == {"reference": f"{repo}:nothere", "digest": None, "deleted": False, "tags_removed": []}


def test_delete_by_digest_names_the_tags_it_took(diskkit, image):
    repo, digest = image
    assert diskkit("tag", INSECURE, f"{repo}@{digest}", "40").code == 0
    result = diskkit("delete", INSECURE, "--json", f"{repo}@{digest}")
    assert result.code == 0, result.err
    assert json.loads(result.out)["tags_removed"] == ["40", "v1"]
    again = diskkit("delete", INSECURE, f"{repo}@{digest}")
    assert again.code != 0 and f"no such manifest {digest}" in again.err


def test_tag_refuses_a_registry_that_stores_another_digest(diskkit, image, registry, fault_proxy, tmp_path):
    repo, digest = image
    other = diskkit("build", make_qcow2(tmp_path / "o.qcow2", pattern=5), "-t", f"{repo}:other", INSECURE).last_line
    proxy = fault_proxy(registry)
    # a lying registry: the new tag, read back, answers with another image
    proxy.add(Fault("HEAD", r"/manifests/promoted$", "rewrite", to="/manifests/other"))
    lied = diskkit("tag", INSECURE, f"{repo.replace(registry.host, proxy.host)}@{digest}", "promoted")
    assert lied.code != 0
    assert f":promoted: registry stored {other}, not the source's {digest}" in lied.err


def test_tag_tags_and_delete_through_token_auth(diskkit, token_registry, qcow2):
    repo = new_repo(token_registry)
    creds = f"--creds={token_registry.username}:{token_registry.password}"
    digest = diskkit("build", qcow2, "-t", f"{repo}:v1", INSECURE, creds).last_line
    assert diskkit("tag", INSECURE, creds, f"{repo}@{digest}", "40").code == 0
    listed = diskkit("tags", INSECURE, creds, repo)
    assert listed.code == 0 and sorted(listed.out.split()) == ["40", "v1"], listed.err
    refused = diskkit("delete", INSECURE, creds, f"{repo}:40")
    assert refused.code != 0 and "also tagged v1" in refused.err
    forced = diskkit("delete", INSECURE, creds, "--force", f"{repo}:40")
    assert forced.code == 0 and forced.last_line == digest, forced.err
    gone = diskkit("tag", INSECURE, creds, f"{repo}:v1", "x")  # v1 went with the digest
    assert gone.code != 0 and f"{repo}:v1: no such tag" in gone.err
