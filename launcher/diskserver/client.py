"""How `launcher run` uses the node's disk server (found or started by launcher.diskserver.spawn):
have it export an image's disk, or take kernelBoot files out of one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.disk.diskrules import violations
from diskkit.errors import DiskkitError, Exit
from diskkit.layers import lazytoc
from diskkit.oci.image import Platform, parse_json
from diskkit.oci.reference import parse_ref
from diskkit.registry import authfile, registriesconf, tlsfiles
from diskkit.registry.options import RegistryOptions
from diskkit.transports import open_source
from launcher.diskserver.control import CONTROL_SOCKET, credentials_to_wire, identities_to_wire, request, serve_dir, socket_path
from launcher.diskserver.spawn import ensure_server
from launcher.node.cache import Cache
from launcher.node.pull import Pulled, present


@dataclass(frozen=True)
class Attached:
    """A containerDisk served by the node's disk server: what the VM's overlay is made over."""

    url: str
    export: str
    socket: str
    format: str
    virtual_size: int
    pulled: Pulled


def attach(cache: Cache, ref: str, path: str | None, platform: Platform | None, registry: RegistryOptions | None,
           mode: str, policy: str, notes: list[str], vm: bool = True, qemu_uid: int | None = None,
           trace: str | None = None) -> Attached | None:
    """Serve `ref`'s disk lazily when `mode` ("on", or "auto" for images marked lazy) allows; None: pull it whole.

    The disk is checked as a pull checks it (KubeVirt's qemu-img info rules), read through the export.
    Without `vm` (a dry run) the server is not told to wait for a VM's qemu. `qemu_uid`: a root
    launcher's qemu runs as that user (a session daemon's), whose own NBD socket it is given.
    `trace`: a token under which the server records the VM's reads (launcher.diskserver.recording),
    served so even when the node holds the disk already."""
    parsed = parse_ref(ref)
    if mode == "off" or parsed.transport != "docker":
        if mode == "on":
            notes.append(f"{parsed}: lazy reads need a registry image; pulling it whole")
        return None
    if policy == "Never" or (trace is None and present(cache, ref, path, platform, policy) is not None):
        return None  # already here (a plain file beats any server; the pull admits it), or not to be fetched at all
    parsed = parse_ref(qualified(str(parsed), registry))
    if mode == "auto" and not _marked(str(parsed), registry, platform):
        return None
    answer = _ask(cache, registry, notes, {
        "op": "open", "image": str(parsed), "path": path, "platform": str(platform) if platform else None,
        **registry_request(str(parsed), registry), "marked": mode == "auto",
        "clients": 2 if vm else 1, **({"qemu_uid": qemu_uid} if qemu_uid is not None else {}),  # the probe below, then the VM's qemu: the server waits for both
        **({"trace": trace} if trace is not None else {})})
    if answer is None:
        return None
    info = qemuimg.info(answer["url"])  # probes the format through the export, under qemu-img's limits
    problems = violations(info)
    if problems:
        raise DiskkitError(str(parsed), "; ".join(f"/{answer['member']}: {p}" for p in problems))
    # Named as asked: the export may be one another tag of the same digest opened first.
    pulled = Pulled(Path(answer["disk"]), info.format, info.virtual_size, str(parse_ref(ref)), answer["digest"], answer["layer"], answer["member"])
    if trace is not None:  # the probe above is not the guest's boot: only the VM connects under the trace's name
        return Attached(answer["traceUrl"], answer["trace"], answer["socket"], info.format, info.virtual_size, pulled)
    return Attached(answer["url"], answer["export"], answer["socket"], info.format, info.virtual_size, pulled)


def take_traces(cache: Cache, token: str) -> list[dict]:
    """The reads recorded under `token` by the node's disk server, one trace per traced export; recording ends."""
    answer = request(socket_path(serve_dir(cache), CONTROL_SOCKET), {"op": "trace", "trace": token}, timeout=60)
    if not answer.get("ok"):
        raise DiskkitError(cache.root, f"the disk server gave no trace: {answer.get('error')}")
    return answer["traces"]


def files(cache: Cache, ref: str, paths: list[str], platform: Platform | None, registry: RegistryOptions | None,
          mode: str, policy: str, notes: list[str]) -> dict[str, Pulled] | None:
    """kernelBoot files taken out of a lazy image by the node's server (its disk layer not fetched
    for them; the members around a disk it exports not fetched twice); None: pull them whole (or
    from the cache, which holds them all)."""
    parsed = parse_ref(ref)
    if mode == "off" or parsed.transport != "docker" or policy == "Never":
        return None  # local images cost nothing to read whole; Never is the pull's to refuse in its words
    if all(present(cache, ref, path, platform, policy, disk=False) is not None for path in paths):
        return None  # the pull admits them from the cache, and says so
    parsed = parse_ref(qualified(str(parsed), registry))
    if mode == "auto" and not _marked(str(parsed), registry, platform):
        return None
    answer = _ask(cache, registry, notes, {
        "op": "files", "image": str(parsed), "paths": paths, "platform": str(platform) if platform else None,
        **registry_request(str(parsed), registry), "marked": mode == "auto"})
    if answer is None:
        return None
    return {path: Pulled(**{**got, "path": Path(got["path"]), "image": str(parse_ref(ref))}) for path, got in answer["files"].items()}


def registry_request(ref: str, registry: RegistryOptions | None) -> dict:
    """The registry part of a request: the options without credentials or auth file paths, and what
    this client holds for every host the image may be read from (its mirrors too), as its own pull
    would use it: credentials (a VMI's imagePullSecret, else `--creds` or the auth files) and its TLS
    client identity. The node's server may be another user: it uses these or none, never its own."""
    opts = registry or RegistryOptions()
    name = parse_ref(ref).name
    found, identities = [], []
    for host in dict.fromkeys(source.name.registry for source in registriesconf.load().pull_sources(name)):
        creds = authfile.held(host, opts)
        if creds is not None:
            found.append((host, creds))
        identity = tlsfiles.held(host, opts)
        if identity is not None:
            identities.append((host, identity))
    options = None
    if registry is not None:
        options = {k: v for k, v in asdict(registry).items() if k not in ("creds", "authfile", "inline_credentials", "inline_identities")}
    return {"registry": options, "credentials": credentials_to_wire(found), "identities": identities_to_wire(identities)}


def _marked(ref: str, registry: RegistryOptions | None, platform: Platform | None) -> bool:
    """Whether the image says it can boot lazily, from its manifest alone: no blob of an image is read
    before the policy has admitted it (the server does, launcher.node.admission)."""
    with open_source(ref, registry) as source:
        data, _, _, _, layers = source.platform_manifest(platform)
    return lazytoc.marked(parse_json(data, ref), layers)


def _ask(cache: Cache, registry: RegistryOptions | None, notes: list[str], req: dict) -> dict | None:
    """The node server's answer; None (and a note) where the image is to be pulled whole instead."""
    answer = request(ensure_server(cache, registry), req)
    if answer.get("ok"):
        return answer
    if answer.get("seekable") is False:
        notes.append(f"{answer['reason']}; pulling it whole")
        return None
    refused = DiskkitError(answer.get("error") or "the disk server refused the image")
    if answer.get("exit") in set(Exit):
        refused.exit_code = Exit(answer["exit"])
    raise refused


def qualified(ref: str, registry: RegistryOptions | None) -> str:
    """A short name resolved here, through this user's registries.conf, as `launcher pull` resolves
    it (the first candidate that has the image): the node's server may run as another user, with
    other files or none, so it is only ever sent full names."""
    short = parse_ref(ref).short
    if short is None:
        return ref
    candidates = [f"docker://{name}" for name in registriesconf.load().short_name_candidates(short)]
    if len(candidates) == 1:
        return candidates[0]  # an alias, or one search registry: nothing to ask
    failures = []
    for candidate in candidates:
        try:
            with open_source(candidate, registry) as source:
                source.top_manifest()
            return candidate
        except DiskkitError as exc:
            failures.append(f"{candidate}: {exc.rule}")
    raise DiskkitError(ref, "no candidate of the short name has it (" + "; ".join(failures) + ")")


def last_failure(cache: Cache) -> str | None:
    """Why the node's disk server last failed to fetch (a registry away), if it is failing now."""
    try:
        answer = request(socket_path(serve_dir(cache), CONTROL_SOCKET), {"op": "status"}, timeout=5)
    except (OSError, ValueError, DiskkitError):
        return None
    failures = [e["lastFailure"] for e in answer.get("exports", []) if e.get("lastFailure")]
    return failures[0] if failures else None


def forget(cache_root: Path, uid: int) -> None:
    """Tell the disk server of the cache at `cache_root`, if one runs, that `uid` goes to another VM:
    what it was answered with is no longer its own (launcher.runtime.vmuser)."""
    control = cache_root / "serve" / CONTROL_SOCKET
    if not control.exists():
        return
    try:
        answer = request(control, {"op": "forget", "uid": uid}, timeout=30)
    except (OSError, ValueError):
        return  # none answers: the next server starts with no grant at all
    if not answer.get("ok"):
        raise DiskkitError(control, f"the disk server would not forget uid {uid}: {answer.get('error')}")

