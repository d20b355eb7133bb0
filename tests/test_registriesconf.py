"""registries.conf: mirrors, insecure, blocked, aliases and unqualified search, side by side with
skopeo (and podman for short names, which skopeo never resolves) on the same files, against the
loopback registry from tests/distribution.py. Every name used is on loopback: a prefix that only
registries.conf maps somewhere would send DNS queries out if a peer ignored the file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from diskkit.oci.reference import parse_docker_name
from diskkit.registry import registriesconf
from tests.conftest import make_qcow2, run_diskkit, run_launcher
from tests.engines import podman_env


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory) -> str:
    """The test image at REGISTRY/mirror/x:v1; returns its manifest digest."""
    root = tmp_path_factory.mktemp("rc")
    disk = make_qcow2(root / "d.qcow2", "16M", 0x7A)
    result = run_diskkit("build", disk, "-t", f"{registry.host}/mirror/x:v1", "--tls-verify=false")
    assert result.code == 0, result.err
    return result.out.strip().splitlines()[-1]


def conf_env(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "registries.conf"
    path.write_text(text)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"CONTAINERS_REGISTRIES_CONF": str(path), "HOME": str(home)}


def skopeo_digest(env: dict, ref: str) -> tuple[int, str]:
    # skopeo 1.9 ignores CONTAINERS_REGISTRIES_CONF: it takes the same file as --registries-conf.
    flags = ["--registries-conf", env["CONTAINERS_REGISTRIES_CONF"]] if "CONTAINERS_REGISTRIES_CONF" in env else []
    proc = subprocess.run(["skopeo", *flags, "inspect", "--raw", ref], capture_output=True, env={**os.environ, **env})
    if proc.returncode != 0:
        return proc.returncode, proc.stderr.decode()
    import hashlib

    return 0, "sha256:" + hashlib.sha256(proc.stdout).hexdigest()


def ours_digest(env: dict, ref: str, tmp_path: Path) -> tuple[int, str]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    result = run_diskkit("push", "--json", ref, f"oci:{out}:v1", env=env)
    if result.code != 0:
        return result.code, result.err
    return 0, json.loads(result.out)["digest"]


def test_mirror_first_then_the_registry(registry, pushed, tmp_path):
    h = registry.host
    cases = {
        # The mirror has it: the (missing) primary location is never needed.
        "mirror": f'[[registry]]\nprefix = "{h}/alias/x"\nlocation = "{h}/primary/x"\ninsecure = true\n'
                  f'[[registry.mirror]]\nlocation = "{h}/mirror/x"\ninsecure = true\n',
        # The mirror lacks it: the registry itself answers.
        "fallback": f'[[registry]]\nprefix = "{h}/alias/x"\nlocation = "{h}/mirror/x"\ninsecure = true\n'
                    f'[[registry.mirror]]\nlocation = "{h}/empty/x"\ninsecure = true\n',
    }
    for name, text in cases.items():
        env = conf_env(tmp_path, text)
        theirs = skopeo_digest(env, f"docker://{h}/alias/x:v1")
        ours = ours_digest(env, f"docker://{h}/alias/x:v1", tmp_path)
        assert theirs == ours == (0, pushed), name


def test_mirror_by_digest_only_is_skipped_for_tags(registry, pushed, tmp_path):
    h = registry.host
    text = (f'[[registry]]\nprefix = "{h}/alias/x"\nlocation = "{h}/primary/x"\ninsecure = true\nmirror-by-digest-only = true\n'
            f'[[registry.mirror]]\nlocation = "{h}/mirror/x"\ninsecure = true\n')
    env = conf_env(tmp_path, text)
    assert skopeo_digest(env, f"docker://{h}/alias/x:v1")[0] != 0
    assert ours_digest(env, f"docker://{h}/alias/x:v1", tmp_path)[0] != 0
    by_digest = f"docker://{h}/alias/x@{pushed}"
    assert skopeo_digest(env, by_digest) == ours_digest(env, by_digest, tmp_path) == (0, pushed)


def test_insecure_allows_plain_http_and_blocked_refuses(registry, pushed, tmp_path):
    ref = f"docker://{registry.host}/mirror/x:v1"
    env = conf_env(tmp_path, f'[[registry]]\nlocation = "{registry.host}"\ninsecure = true\n')
    assert skopeo_digest(env, ref) == ours_digest(env, ref, tmp_path) == (0, pushed)
    env = conf_env(tmp_path, f'[[registry]]\nlocation = "{registry.host}"\ninsecure = true\nblocked = true\n')
    assert skopeo_digest(env, ref)[0] != 0
    code, err = ours_digest(env, ref, tmp_path)
    assert code != 0 and f"registry {registry.host} is blocked in {tmp_path / 'registries.conf'}" in err
    # Without the insecure entry a plain-HTTP registry is refused by both.
    env = conf_env(tmp_path, "")
    assert skopeo_digest(env, ref)[0] != 0 and ours_digest(env, ref, tmp_path)[0] != 0



def test_an_explicit_tls_verify_wins_over_insecure_and_no_flag_lets_it_decide(tls_registry, tmp_path):
    """containers/image docker/docker_client.go (detectPropertiesHelper): registries.conf's insecure
    applies only while DockerInsecureSkipTLSVerify is undefined; --tls-verify=true makes it verify."""
    ref = f"docker://{tls_registry.host}/tlsconf/x:v1"
    built = run_diskkit("build", "--cert-dir", tls_registry.ca_dir, make_qcow2(tmp_path / "d.qcow2", "8M", 0x3C), "-t", ref)
    assert built.code == 0, built.err
    pushed = built.last_line
    env = conf_env(tmp_path, f'[[registry]]\nlocation = "{tls_registry.host}"\ninsecure = true\n')
    conf = ["--registries-conf", env["CONTAINERS_REGISTRIES_CONF"]]

    def skopeo(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["skopeo", *conf, *map(str, args)], capture_output=True, text=True, env={**os.environ, **env})

    def ours(*args):
        return run_diskkit(*args, env=env)

    out = tmp_path / "out"
    # No flag: the entry's insecure decides (the test CA is unknown, yet both read the image).
    assert skopeo("inspect", "--raw", ref).returncode == 0
    read = ours("push", "--json", ref, f"oci:{out}:a")
    assert read.code == 0 and json.loads(read.out)["digest"] == pushed, read.err
    # --tls-verify=true (and --src-tls-verify=true): verified, so the unknown CA is refused by both.
    # Bare, as skopeo (pflag) reads them: true, and the next argument stays a positional.
    for flags in (["--tls-verify=true"], ["--src-tls-verify=true"], ["--tls-verify"], ["--src-tls-verify"]):
        theirs = skopeo("copy", *flags, ref, f"oci:{out}:b")
        assert theirs.returncode != 0 and "certificate" in theirs.stderr, (flags, theirs.stderr)
        refused = ours("copy", *flags, ref, f"oci:{out}:b")
        assert refused.code != 0 and "TLS verification failed" in refused.err, (flags, refused.err)
    # ... and with the CA it is trusted: verifying, not refusing.
    trusted = ours("inspect", "--raw", "--tls-verify=true", "--cert-dir", tls_registry.ca_dir, ref)
    assert trusted.code == 0, trusted.err
    # The destination side: --dest-tls-verify=true refuses the push, no flag lets insecure allow it.
    dest = f"docker://{tls_registry.host}/tlsconf/y:v1"
    theirs = skopeo("copy", "--dest-tls-verify=true", f"oci:{out}:a", dest)
    assert theirs.returncode != 0 and "certificate" in theirs.stderr, theirs.stderr
    refused = ours("copy", "--dest-tls-verify=true", f"oci:{out}:a", dest)
    assert refused.code != 0 and "TLS verification failed" in refused.err, refused.err
    allowed = ours("copy", f"oci:{out}:a", dest)
    assert allowed.code == 0 and allowed.last_line == pushed, allowed.err
    # --tls-verify=false still relaxes a registry registries.conf does not mention.
    (tmp_path / "empty").mkdir()
    env.update(conf_env(tmp_path / "empty", ""))
    assert ours("inspect", "--raw", ref).code != 0
    assert ours("inspect", "--raw", "--tls-verify=false", ref).code == 0

def podman_pull_digest(env: dict, name: str, tmp_path: Path) -> str:
    store = tmp_path / "podman"
    store.mkdir(exist_ok=True)
    full = {**os.environ, **env, **podman_env(store)}
    proc = subprocess.run(["podman", "pull", "-q", name], capture_output=True, text=True, env=full)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(["podman", "image", "inspect", "--format", "{{.Digest}}", name], capture_output=True, text=True, env=full)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_short_names_resolve_as_podman_resolves_them(registry, pushed, tmp_path):
    h = registry.host
    insecure = f'[[registry]]\nlocation = "{h}"\ninsecure = true\n'
    # An alias wins over the search list.
    env = conf_env(tmp_path, f'unqualified-search-registries = ["{h}"]\n{insecure}[aliases]\n"x" = "{h}/mirror/x"\n')
    assert ours_digest(env, "x:v1", tmp_path) == (0, pushed)
    assert podman_pull_digest(env, "x:v1", tmp_path) == pushed
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", "--json", "x:v1", env=env)
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["digest"] == pushed
    # No alias: the search registries in order; a registry that refuses connections is passed over.
    env = conf_env(tmp_path, f'short-name-mode = "permissive"\nunqualified-search-registries = ["127.0.0.1:9", "{h}"]\n{insecure}')
    assert ours_digest(env, "mirror/x:v1", tmp_path) == (0, pushed)
    # Enforcing with several candidates and no terminal: podman's refusal.
    env = conf_env(tmp_path, f'short-name-mode = "enforcing"\nunqualified-search-registries = ["127.0.0.1:9", "{h}"]\n{insecure}')
    code, err = ours_digest(env, "mirror/x:v1", tmp_path)
    assert code != 0 and "short-name resolution enforced but cannot prompt without a TTY" in err
    # Nothing to search: a one-line error naming the files read.
    env = conf_env(tmp_path, insecure)
    code, err = ours_digest(env, "mirror/x:v1", tmp_path)
    assert code != 0 and "no unqualified-search registries are defined" in err


def test_files_are_read_in_podmans_order(tmp_path):
    home = tmp_path / "home"
    (home / ".config/containers/registries.conf.d").mkdir(parents=True)
    (home / ".config/containers/registries.conf.d/10-a.conf").write_text('unqualified-search-registries = ["a.example"]\n[aliases]\n"y" = "a.example/y"\n')
    (home / ".config/containers/registries.conf.d/20-b.conf").write_text('unqualified-search-registries = ["b.example"]\n')
    explicit = tmp_path / "explicit.conf"
    explicit.write_text('unqualified-search-registries = ["main.example"]\nshort-name-mode = "disabled"\n')
    conf = registriesconf.load({"HOME": str(home), "CONTAINERS_REGISTRIES_CONF": str(explicit)})
    assert conf.search == ["b.example"] and conf.mode == "disabled" and conf.aliases["y"] == "a.example/y"
    # A user registries.conf replaces the system file and brings only the user's drop-in directory.
    (home / ".config/containers/registries.conf").write_text('unqualified-search-registries = ["user.example"]\n')
    conf = registriesconf.load({"HOME": str(home)})
    assert conf.search == ["b.example"] and "alpine" not in conf.aliases  # the system shortnames.conf is not read


@pytest.mark.parametrize("text, words", [
    ('[[registry]]\nlocation = "https://x.example"\n', "URI schemes are not supported"),
    ('[[registry]]\ninsecure = true\n', "both location and prefix are unset"),
    ('[[registry]]\nprefix = "*.x.example/a"\n', "Wildcarded prefix should be in the format"),
    ('[[registry]]\nlocation = "x.example"\n[[registry.mirror]]\nlocation = "m.example"\npull-from-mirror = "sometimes"\n', "unsupported pull-from-mirror value"),
    ('[registries.search]\nregistries = ["x.example"]\n', "v1"),
    ('short-name-mode = "ask"\n', "invalid short-name mode"),
    ('[aliases]\n"x" = "y"\n', "must be a fully qualified name"),
])
def test_invalid_files_are_refused_with_containers_image_words(text, words):
    with pytest.raises(DiskkitError) as info:
        registriesconf.parse(text, "r.conf")
    assert words in info.value.rule


def test_prefix_rewrite_and_wildcards():
    conf = registriesconf.parse(
        '[[registry]]\nprefix = "example.com/foo"\nlocation = "mirror.local/bar"\n'
        '[[registry]]\nprefix = "*.corp.example"\nblocked = true\n', "r.conf")
    assert [str(s.name) for s in conf.pull_sources(parse_docker_name("example.com/foo/img:1"))] == ["mirror.local/bar/img:1"]
    assert [str(s.name) for s in conf.pull_sources(parse_docker_name("example.com/foobar:1"))] == ["example.com/foobar:1"]
    with pytest.raises(DiskkitError, match="is blocked"):
        conf.pull_sources(parse_docker_name("reg.corp.example/x:1"))


def test_a_short_name_is_judged_by_the_policy_as_the_name_it_resolved_to(registry, pushed, tmp_path):
    # containers/image resolves a short name before it builds the reference the policy judges
    # (pkg/shortnames, then signature/policy_eval.go on that reference): docker.io is never asked.
    h = registry.host
    env = conf_env(tmp_path, f'[[registry]]\nlocation = "{h}"\ninsecure = true\n[aliases]\n"x" = "{h}/mirror/x"\n')
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "reject"}],
                                  "transports": {"docker": {f"{h}/mirror": [{"type": "insecureAcceptAnything"}]}}}))
    out = tmp_path / "accepted"
    result = run_diskkit("push", "--signature-policy", policy, "x:v1", f"oci:{out}:v1", env=env)
    assert result.code == 0, result.err
    # The launcher reads the user's policy.json (it has no flag for one).
    user_policy = Path(env["HOME"]) / ".config/containers/policy.json"
    user_policy.parent.mkdir(parents=True)
    user_policy.write_text(policy.read_text())
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", "--json", "x:v1", env=env)
    assert pulled.code == 0, pulled.err
    # And the other way round: a policy that accepts only docker.io refuses what x really is.
    policy.write_text(json.dumps({"default": [{"type": "reject"}],
                                  "transports": {"docker": {"docker.io": [{"type": "insecureAcceptAnything"}]}}}))
    refused = run_diskkit("push", "--signature-policy", policy, "x:v1", f"oci:{tmp_path}/refused:v1", env=env)
    assert refused.code != 0 and f"docker://{h}/mirror/x:v1" in refused.err, refused.err
