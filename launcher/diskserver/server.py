"""`launcher serve`: the node's disk server.

One process per node cache. It exports each lazily read disk over NBD on `<cache>/serve/nbd.sock`
(one export per identity, launcher.diskserver.exportid: everything that pins its bytes, shared by
every VM on the node that opens an image pinning the same ones) and takes requests on
`<cache>/serve/control.sock` (launcher.diskserver.control has the protocol). Exports are set up
under a lock each: a registry that trickles holds up only the opens of what it serves.

Registry options come with each request, so every VM's pull secret is used for its own image. The
server's own credentials (its auth file, the client certificate in its cert directory) serve only
its own user and root (and exports it reopens after a restart); a client of another uid sends its
own credentials and TLS identity inline, or none, and the manifest fetch with them decides whether
it gets an export, on an NBD socket that serves it nothing else (launcher.diskserver.clientoptions).

Who may connect: run as root, the control socket is mode 0660 in the launcher users' group
(`--socket-group`, else the group of KubeVirt's qemu user: launcher.diskserver.qemuid.launcher_group),
or 0600 where there is none; `nbd.sock` is mode 0660 in the group libvirt's system daemon runs qemu
as (launcher.diskserver.qemuid: qemu.conf's `group`, else libvirt's built-in one), for VMs that
root starts on qemu:///system; a VM of another user runs on that user's qemu:///session as that
user, so its launcher is answered with `nbd-<uid>.sock`, owned by it, mode 0600. Not run as root,
both sockets are 0600: the launcher and its qemu share the server's user.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.disk import diskheader
from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci.image import Platform
from diskkit.oci.reference import parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.transports.remote import RemoteSource, registry_for
from launcher.chunks.index import ChunkIndex, reuse_allowed
from launcher.chunks.source import LocalChunks
from launcher.diskserver import firstbytes, nbd
from launcher.diskserver.control import (
    CONTROL_SOCKET,
    NBD_SOCKET,
    REQUEST_TIMEOUT,
    credentials_from_wire,
    identities_from_wire,
    recv_line,
    serve_dir,
    socket_path,
)
from launcher.diskserver.blobranges import BlobRanges, KnownRanges, RememberedRanges, SmallBlobs
from launcher.diskserver.chunksources import EachChunk
from launcher.diskserver.clientoptions import for_client
from launcher.diskserver.imagewalk import NotSeekable
from launcher.diskserver.installed import InstalledDisk, Ref, record
from launcher.diskserver.layout import Found, Layout, find_layout
from launcher.diskserver.lazydisk import LazyDisk, Options
from launcher.diskserver.lazyfiles import take_files
from launcher.diskserver.linkshare import LinkShare
from launcher.diskserver.registrychunks import RegistryChunks
from launcher.diskserver.qemuid import launcher_group, system_qemu_gid
from launcher.diskserver.recording import Recordings, base_name
from launcher.diskserver.traceplan import follow
from launcher.hostfs.dirfd import own_directory
from launcher.node.admission import admitted
from launcher.node.cache import Cache
from launcher.node.pull import image_key, remember

log = logging.getLogger("launcher.serve")

MAX_REQUEST = 1 << 20
HOLD = 600.0  # an opened export waits this long at most for the VMs announced with it to connect
SWITCH_INTERVAL = 0.0005
GRACE = 5.0  # after its last VM disconnected, a server exiting by itself waits this long for another


@dataclass
class ServeOptions:
    socket_dir: Path | None = None
    registry: RegistryOptions = field(default_factory=RegistryOptions)
    lazy: Options = field(default_factory=Options)
    exit_when_idle: float | None = None  # seconds with no VM connected and nothing left to fetch
    socket_group: str | None = None  # who may send requests (root only); None: launcher_group's default


def _lock_path(cache: Cache) -> Path:
    return cache.root / "serve" / "server.lock"


def lazy_leftovers(cache: Cache) -> list[Path]:
    """Partly fetched disks (and records of installed ones) that no server is using: gc may take them."""
    lazy = cache.root / "lazy"
    if not lazy.is_dir():
        return []
    try:
        fd = os.open(_lock_path(cache), os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return []  # a server runs: its exports' state is in use
        return sorted(p for p in lazy.iterdir() if p.is_dir())
    finally:
        if fd is not None:
            os.close(fd)


class DiskServer:
    def __init__(self, cache: Cache, opts: ServeOptions):
        self.cache = cache
        self.opts = opts
        self.root = os.geteuid() == 0
        if not self.root and opts.socket_group is not None:
            raise DiskkitError(f"--socket-group {opts.socket_group}", "only a disk server run as root opens its control socket to a group")
        group = launcher_group(opts.socket_group) if self.root else None
        if self.root and group is None:
            log.info("no qemu user or group here: the control socket is root's alone (--socket-group opens it to one)")
        self.mode, self.group = (0o660, group) if group is not None else (0o600, None)
        self.dir = serve_dir(cache, opts.socket_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Refused before anything is made in it.
        own_directory(self.dir, "--socket-dir" if opts.socket_dir else "socket directory", root_mode=0o755)
        self.nbd_path = socket_path(self.dir, NBD_SOCKET)
        self.control_path = socket_path(self.dir, CONTROL_SOCKET)
        self._lock_fd = self._take_lock()
        self._reclaim_staging()
        self.exports: dict[str, LazyDisk | InstalledDisk] = {}
        self.lock = threading.Lock()
        self.setup_locks: dict[str, threading.Lock] = {}  # export name -> held while that export is made
        self.small_blobs = SmallBlobs()
        self.link = LinkShare()  # one link for every export's fetches
        self.chunk_index = ChunkIndex(cache)
        # Opened (and, when missing, rebuilt by hashing the cache's disks) now, not in a booting VM's first read.
        threading.Thread(target=self._open_chunk_index, name="chunk-index", daemon=True).start()
        self.last_activity = time.monotonic()
        self.awaiting: dict[str, list[tuple[float, int]]] = {}  # export -> (deadline, asking pid) per announced NBD client
        self.openers: dict[str, set[int]] = {}  # export -> the runs that opened it, until all have left
        self.served = False  # some NBD client connected: when the last one leaves, the work is done
        # A run that announced its VM went before the VM connected (killed, or failed to start it): the run
        # the server waited for came and went, as a VM that disconnected.
        self.deserted = False
        self.stopping = threading.Event()
        if self.root:
            self.nbd = nbd.Server(self.nbd_path, self, 0o660, system_qemu_gid())
        else:
            self.nbd = nbd.Server(self.nbd_path, self, 0o600)
        self.user_nbd: dict[int, nbd.Server] = {}  # uid -> the socket of that user's session VMs
        self.granted: dict[int, set[str]] = {}  # uid -> the exports its opens were answered with: all its socket serves
        self.recordings = Recordings()  # boots whose reads are being traced (launcher.diskserver.recording)
        self.control = self._listen(self.control_path)

    def _nbd_for(self, peer_uid: int | None, *names: str) -> nbd.Server:
        """The NBD socket the VM of the launcher at the other end of a control request can reach,
        `names` now served on it."""
        if not self.root or peer_uid in (None, 0):
            return self.nbd
        with self.lock:
            self.granted.setdefault(peer_uid, set()).update(names)
            server = self.user_nbd.get(peer_uid)
            if server is None:
                path = socket_path(self.dir, f"nbd-{peer_uid}.sock")
                server = nbd.Server(path, _Granted(self, peer_uid), 0o600, owner=peer_uid).start()
                self.user_nbd[peer_uid] = server
        return server

    def forget(self, request: dict, peer_uid: int | None) -> dict:
        """A uid's grants and NBD socket go: a root launcher says so of a VM's own uid before it gives that
        uid to another VM (launcher.runtime.vmuser), which must not read what the first one was answered with."""
        uid = request.get("uid")
        if not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0:
            raise DiskkitError("forget", "needs a uid")
        if peer_uid not in (0, os.geteuid()):
            raise DiskkitError("forget", "only root or the server's own user may make the server forget a uid")
        with self.lock:
            self.granted.pop(uid, None)
            server = self.user_nbd.pop(uid, None)
        if server is not None:
            server.close()
        return {"ok": True}

    @property
    def connections(self) -> int:
        with self.lock:
            servers = [self.nbd, *self.user_nbd.values()]
        return sum(server.connections for server in servers)

    def _take_lock(self) -> int:
        # In the cache, wherever the sockets are: one server per cache, and gc can tell whether it runs.
        path = _lock_path(self.cache)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            # Another user who could open it could hold a shared lock on it, and no server would start.
            os.fchmod(fd, 0o600)
        except OSError as exc:
            raise DiskkitError(path, f"cannot be opened ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DiskkitError(self.cache.root, f"a disk server (pid {pid}) already serves this cache") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _reclaim_staging(self) -> None:
        """Exports a killed server was setting up (hidden directories in lazy/): with the lock held, no one else's."""
        lazy = self.cache.root / "lazy"
        for staging in sorted(lazy.glob(".*")) if lazy.is_dir() else []:
            shutil.rmtree(staging, ignore_errors=True)
            log.info("removed %s, left by a server that was killed", staging)

    def _listen(self, path: Path) -> socket.socket:
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(path, -1, self.group)
        os.chmod(path, self.mode)
        sock.listen(16)
        return sock

    # --- exports, as the NBD server sees them ---------------------------------------------------

    def lookup(self, name: str):
        base = base_name(name)
        if base is not None:
            return self.recordings.lookup(name, self.lookup(base))  # a traced VM's name for the export
        with self.lock:
            export = self.exports.get(name)
        if export is None:
            export = self._reopen(name)
        if export is not None:
            self.last_activity = time.monotonic()
            with self.lock:
                self.served = True
                announced = self.awaiting.get(name)
                if announced:
                    announced.pop(0)
            if isinstance(export, LazyDisk):
                export.touch()
        return export

    def listing(self) -> list:
        with self.lock:
            return list(self.exports.values())

    def _reopen(self, name: str):
        """An export known from an earlier run of the server (a VM reconnecting after a restart)."""
        if not _is_export_name(name):
            return None
        source = self.cache.read_json(self.cache.root / "lazy" / name / "source.json")
        if source is None:
            return None
        try:
            layout = Layout.from_json(source["layout"])
        except (KeyError, TypeError, ValueError):
            log.warning("export %s cannot be reopened: its source.json is not one this server wrote", name)
            return None
        if layout.name != name:
            # Written for another identity (or by an older server, keyed by less): never served under this name.
            log.warning("export %s cannot be reopened: its source.json describes another export", name)
            return None
        try:
            return self._export(layout, registry_for(layout.registry, self.opts.registry))
        except DiskkitError as exc:
            log.warning("export %s cannot be reopened: %s", name, exc.line())
            return None

    def _export(self, layout: Layout, registry, found: Found | None = None,
                held: list[tuple[int, bytes]] = ()) -> LazyDisk | InstalledDisk:
        """The export for `layout`'s identity, made once: later VMs booting the same bytes share it.
        Set up under a lock of its own: an open of another image never waits for this one's registry."""
        name = layout.name
        with self.lock:
            setting_up = self.setup_locks.setdefault(name, threading.Lock())
        with setting_up:
            with self.lock:
                if name in self.exports:
                    return self.exports[name]
            # Verified against the blob digest before it was installed: the layer and member pin it.
            installed = self.cache.disk_dir(layout.layer, layout.member) / "disk.img"
            if installed.is_file():
                export = InstalledDisk(name, installed, f"{layout.layer} /{layout.member}")
            else:
                ranges = BlobRanges(registry, layout.repository, layout.layer, layout.layer_size)
                head, tail = (found.head, found.tail) if found is not None else (None, None)
                export = LazyDisk(self.cache, layout, ranges, self.opts.lazy, head=head, tail=tail,
                                  sources=self._sources(layout, ranges, held), chunk_index=self.chunk_index,
                                  link=self.link)
                export.stats.fetched_bytes += sum(len(data) for _, data in held)  # members the open fetched beside the TOC
                if found is not None:
                    export.touch()  # an open: a VM is about to boot, from its first prefetch request on
                export.start()
            with self.lock:
                self.exports[name] = export
        log.info("exporting %s (%s)", name, "complete" if isinstance(export, InstalledDisk) else "lazy")
        return export

    def _open_chunk_index(self) -> None:
        try:
            self.chunk_index.paths()
        except Exception as exc:  # lookups try again; each failure costs only fetches
            log.warning("the node's chunk index cannot be opened: %s", exc)

    def _sources(self, layout: Layout, ranges: BlobRanges, held: list[tuple[int, bytes]] = ()) -> list:
        """The node's own chunks first (any cached disk or finished export holding a chunk the TOC names
        by content), then the registry's ranges for the rest (`held`: members the open fetched beside
        the TOC). The layout answers what LocalChunks asks of a TOC: the chunks' content hashes and ranges."""
        registry = RegistryChunks(layout, ranges, held, self.link)
        if layout.content_hashes is None or not reuse_allowed():
            return [registry]
        return [EachChunk(LocalChunks(self.chunk_index, self.cache, layout)), registry]

    def _discard(self, export) -> None:
        """A refused export goes, its directory too: what it fetched must not wait in the cache for gc.
        Every open of the same identity reads the same header, so none of them is using it."""
        with self.lock:
            if self.exports.get(export.name) is export:
                del self.exports[export.name]
        if isinstance(export, LazyDisk):
            export.discard()

    # --- control requests -----------------------------------------------------------------------

    def open(self, request: dict, peer_uid: int | None = None, peer_pid: int = 0) -> dict:
        ref = request.get("image")
        if not isinstance(ref, str) or not ref:
            raise DiskkitError("open", "needs an image reference")
        path = request.get("path")
        platform = Platform.parse(request["platform"]) if request.get("platform") else None
        registry = self._registry_options(request, peer_uid)
        shown = str(parse_ref(ref))
        try:
            with self._lazy_image(shown, registry, platform, request.get("marked")) as (source, image, early):
                found = find_layout(image, lambda desc: self.small_blobs.ranges(early.ranges(BlobRanges(source.registry, source.name.repository, desc.digest, desc.size))),
                                    source.registry.host, source.name.repository, path, shown)
                layout = found.layout
                export = self._export(layout, source.registry, found, early.held(layout.layer, layout.data_start, layout.data_end))
                unsafe = _header_problems(export)
                if unsafe:
                    self._discard(export)
                    raise DiskkitError(shown, "; ".join(f"/{layout.member}: {p}" for p in unsafe))
                remember(self.cache, shown, platform, image, source)
        except NotSeekable as exc:
            return {"ok": False, "seekable": False, "reason": exc.line()}
        clients = request.get("clients", 1)
        if not isinstance(clients, int) or not 0 <= clients <= 16:
            raise DiskkitError("open", "clients must be a number of NBD connections from 0 to 16")
        traced = None
        if request.get("trace") is not None:
            traced = self.recordings.start(request["trace"], peer_uid, layout.name, export.size,
                                           {"image": shown, "digest": image.digest, "path": layout.member, "layer": layout.layer})
        listener = self._nbd_for(_qemu_uid(request, peer_uid), layout.name, *([traced] if traced else []))
        if isinstance(export, LazyDisk) and not export.trace_looked_for:
            export.trace_looked_for = True
            threading.Thread(target=follow, args=(export, shown, image.digest, registry), name="trace", daemon=True).start()
        with self.lock:
            # Held while the run that asked lives (a run that failed before its VM started frees it), at most HOLD.
            self.awaiting.setdefault(layout.name, []).extend([(time.monotonic() + HOLD, peer_pid)] * clients)
            self.openers.setdefault(layout.name, set()).add(peer_pid)
        ref_record = Ref(image_key(image.digest, path, platform), shown, image.digest)
        if isinstance(export, LazyDisk):
            export.touch()  # a VM is about to start on it
            export.add_ref(ref_record)
        else:
            record(self.cache, ref_record, export.path)
        return {
            "ok": True,
            "export": layout.name,
            "identity": layout.identity.to_json(),
            "socket": str(listener.path),
            "url": f"nbd+unix:///{layout.name}?socket={listener.path}",
            "image": shown,
            "digest": image.digest,
            "layer": layout.layer,
            "member": layout.member,
            "disk": str(self.cache.disk_dir(layout.layer, layout.member) / "disk.img"),
            "status": export.status(),
            **({"trace": traced, "traceUrl": f"nbd+unix:///{traced}?socket={listener.path}"} if traced else {}),
        }

    def files(self, request: dict, peer_uid: int | None = None) -> dict:
        """kernelBoot files out of a lazy image (launcher.diskserver.lazyfiles), installed in the cache."""
        ref, paths = request.get("image"), request.get("paths")
        if not isinstance(ref, str) or not ref or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise DiskkitError("files", "needs an image reference and a list of paths")
        if not 0 < len(paths) <= 2:
            raise DiskkitError("files", "takes a kernel and an initrd: one or two paths")
        platform = Platform.parse(request["platform"]) if request.get("platform") else None
        registry = self._registry_options(request, peer_uid)
        shown = str(parse_ref(ref))
        try:
            with self._lazy_image(shown, registry, platform, request.get("marked")) as (source, image, early):
                taken = take_files(self.cache, image, shown, paths, platform, lambda desc: self._ranges(source, desc, early), source)
        except NotSeekable as exc:
            return {"ok": False, "seekable": False, "reason": exc.line()}
        return {"ok": True, "files": {path: pulled.to_json() for path, pulled in taken.items()}}

    @contextlib.contextmanager
    def _lazy_image(self, shown: str, registry: RegistryOptions | None, platform: Platform | None, marked: bool):
        """The image a request names, the policy enforced before any byte of it is read; NotSeekable
        when it cannot be read at offsets, or (`marked`) does not say it should be."""
        if parse_ref(shown).transport != "docker":
            raise NotSeekable(shown, "lazy reads need a registry image (docker://)")
        with admitted(shown, registry, platform, self.cache) as source:
            assert isinstance(source, RemoteSource)
            # The lazy layers' TOCs and heads are asked for while the config is read (firstbytes).
            early = firstbytes.ahead(source.top_manifest()[0], source.registry, source.name.repository,
                                     lambda digest: self._exporting(source, digest))
            try:
                image = source.image(platform)
                if marked and not lazytoc.marked(image.manifest, image.layers):
                    raise NotSeekable(shown, f"not marked lazy ({lazytoc.ANNOTATION_LAZY})")
                yield source, image, early
            finally:
                early.close()

    def _ranges(self, source: RemoteSource, desc, early: firstbytes.Early) -> RememberedRanges:
        """A layer's ranges; what an export of it holds already, or a small layer just read whole for
        the disk's lookup, is not fetched again."""
        ranges = early.ranges(BlobRanges(source.registry, source.name.repository, desc.digest, desc.size))
        export = self._exporting(source, desc.digest)
        return self.small_blobs.ranges(KnownRanges(ranges, export.known()) if export is not None else ranges)

    def _exporting(self, source: RemoteSource, digest: str) -> LazyDisk | None:
        """The lazy export of layer `digest` read from `source`'s repository, whose files hold the
        blob's bytes around the disk. Only from the same repository: another image naming this layer
        digest may hold other bytes around its disk until its blob digest says so."""
        for export in self.listing():
            lay = export.layout if isinstance(export, LazyDisk) else None
            if lay is not None and (lay.layer, lay.registry, lay.repository) == (digest, source.registry.host, source.name.repository):
                return export
        return None

    def _registry_options(self, request: dict, peer_uid: int | None) -> RegistryOptions:
        """The request's options, with the credentials and TLS identity its client holds (launcher.diskserver.clientoptions)."""
        return for_client(request.get("registry"), credentials_from_wire(request.get("credentials")),
                          identities_from_wire(request.get("identities")), self.opts.registry, peer_uid in (0, os.geteuid()))

    def status(self, peer_uid: int | None = 0) -> dict:
        """What the server exports; to a client of another uid, only what its own opens were answered with."""
        exports = self.listing()
        if self.root and peer_uid != 0:
            with self.lock:
                mine = set(self.granted.get(peer_uid, ())) if peer_uid is not None else set()
            exports = [export for export in exports if export.name in mine]
        return {"ok": True, "pid": os.getpid(), "socket": str(self.nbd_path), "connections": self.connections,
                "exports": [export.status() for export in exports]}

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(REQUEST_TIMEOUT)
                request = json.loads(recv_line(conn, MAX_REQUEST) or b"{}")
                self.last_activity = time.monotonic()
                op = request.get("op")
                if op == "open":
                    pid, uid = _peer(conn)
                    answer = self.open(request, uid, pid)
                elif op == "files":
                    answer = self.files(request, _peer(conn)[1])
                elif op == "status":
                    answer = self.status(_peer(conn)[1])
                elif op == "forget":
                    answer = self.forget(request, _peer(conn)[1])
                elif op == "trace":
                    answer = {"ok": True, "traces": self.recordings.take(request.get("trace"), _peer(conn)[1])}
                else:
                    answer = {"ok": False, "error": f"control: unknown op {op!r} (open, files, status, forget, trace)"}
            except DiskkitError as exc:
                # The exit status travels too: a client refused by policy exits as a pull refused by it would.
                answer = {"ok": False, "error": exc.line(), "exit": int(exc.exit_code)}
            except (ValueError, TypeError) as exc:
                answer = {"ok": False, "error": f"control: malformed request ({exc})"}
            except OSError:
                return
            except Exception as exc:  # a bug must cost one request, never the server
                log.exception("control request failed")
                answer = {"ok": False, "error": f"internal error: {exc}"}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(answer).encode() + b"\n")
            self.last_activity = time.monotonic()

    def _control_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.control.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="control", daemon=True).start()

    # --- lifetime -------------------------------------------------------------------------------

    def exit_reason(self) -> str | None:
        """Why a server started with exit_when_idle may go now; None while a VM uses it, one is
        announced (an `open` whose VM has not connected yet, as libvirt may take a minute to start
        qemu) or a disk is still being fetched."""
        now = time.monotonic()
        if self.connections:
            self.last_activity = now
            return None
        if self._awaited():
            return None
        with self.lock:
            served, deserted = self.served, self.deserted
        for export in self.listing():
            if not getattr(export, "busy", False):
                continue
            # With no VM reading, a fill that has not moved for a whole fetch timeout is given up (a VM's
            # read would have failed by then too): a server whose registry is gone is not held by
            # retries forever, and outlives its last VM by at most that plus its idle time. The next
            # open starts the fill again.
            stalled = export.stalled_for()
            if stalled < export.opts.fetch_timeout:
                return None
            export.abandon(f"no VM is reading and the fill has not moved for {stalled:.0f} s "
                           f"({export.last_failure or 'the registry does not answer'}): giving up the rest")
        idle = self.opts.exit_when_idle or 0
        # The VMs (or the runs) it was started for came and went: no need to linger.
        limit = min(idle, GRACE) if served or deserted else idle
        if now - self.last_activity < limit:
            return None
        rest = ("the rest of a disk was given up" if any(getattr(e, "abandoned", None) for e in self.listing())
                else "nothing is left to fetch")
        if served:
            return f"its last VM is gone and {rest}"
        if limit < idle:
            return f"the run that asked for a disk is gone before its VM connected and {rest}"
        return f"idle for {limit:g} s and {rest}"

    def _awaited(self) -> set[str]:
        """The exports a live run still announces a VM for (the runs that died and the holds past
        HOLD are dropped)."""
        now = time.monotonic()
        with self.lock:
            for name in list(self.awaiting):
                alive = [(d, pid) for d, pid in self.awaiting[name] if _alive(pid)]
                self.deserted = self.deserted or len(alive) < len(self.awaiting[name])
                self.awaiting[name] = [(d, pid) for d, pid in alive if d > now]
            return {name for name, held in self.awaiting.items() if held}

    def _end_boot_holds(self) -> None:
        """With no VM connected, an export every run that opened it has left has no boot to make way
        for: its rest is fetched now, not once the hold its open or its VM's connection began runs out.
        (A run that lives on holds it: between its `qemu-img info` through the export and its VM's
        connection no NBD client is connected, and the boot is still coming.)"""
        if self.connections:
            return
        with self.lock:
            gone = [name for name, pids in self.openers.items() if not any(_alive(pid) for pid in pids)]
            for name in gone:
                del self.openers[name]
            ended = [self.exports.get(name) for name in gone]
        for export in ended:
            if isinstance(export, LazyDisk):
                export.no_boot()

    def cache_gone(self) -> bool:
        """The cache directory was deleted (or replaced) under the server: nothing it holds is reachable."""
        try:
            st = os.stat(_lock_path(self.cache))
        except OSError:
            return True
        mine = os.fstat(self._lock_fd)
        return (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino)

    def run(self) -> None:
        self.nbd.start()
        threading.Thread(target=self._control_loop, name="control-accept", daemon=True).start()
        log.info("serving NBD on %s, requests on %s (pid %d)", self.nbd_path, self.control_path, os.getpid())
        try:
            while not self.stopping.wait(0.5):
                if self.cache_gone():
                    log.warning("cache directory %s is gone: exiting", self.cache.root)
                    break
                self._end_boot_holds()
                reason = self.exit_reason() if self.opts.exit_when_idle is not None else None
                if reason:
                    log.info("%s: exiting", reason)
                    break
        except KeyboardInterrupt:
            log.info("stopping (signal)")
        finally:
            self.close()
            log.info("stopped")

    def close(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.control.close()
        self.control_path.unlink(missing_ok=True)
        self.nbd.close()
        with self.lock:
            extra = list(self.user_nbd.values())
        for server in extra:
            server.close()
        for export in self.listing():
            if isinstance(export, LazyDisk):
                export.closing.set()  # all at once: each close then has little left to wait for
        for export in self.listing():
            with contextlib.suppress(Exception):
                export.close()
        os.close(self._lock_fd)


class _Granted:
    """What one user's NBD socket serves: the exports that user's own opens were answered with (its
    credentials passed the manifest fetch), never one it could merely name: names are hashes of
    what any manifest tells."""

    def __init__(self, server: DiskServer, uid: int):
        self.server, self.uid = server, uid

    def _names(self) -> set[str]:
        with self.server.lock:
            return set(self.server.granted.get(self.uid, ()))

    def lookup(self, name: str):
        return self.server.lookup(name) if name in self._names() else None

    def listing(self) -> list:
        names = self._names()
        return [export for export in self.server.listing() if export.name in names]


def _peer(conn: socket.socket) -> tuple[int, int | None]:
    """The pid (0 when outside this PID namespace) and uid of a control client."""
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid, uid
    except OSError:
        return 0, None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not ours to see: the deadline alone ends the wait
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _is_export_name(name: str) -> bool:
    """A name ExportId.name could be: a hex sha256, nothing that leads elsewhere in the cache."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _header_problems(export) -> list[str]:
    """A qcow2 header naming host files (backing or data file) is refused before qemu-img sees it, as in pull."""
    try:
        head = export.read(0, min(diskheader.HEADER_BYTES, export.size))
    except nbd.NbdError as exc:
        raise DiskkitError(export.name, f"the disk's first bytes cannot be read ({exc})") from None
    header = diskheader.parse(head)
    return diskheader.safety_violations(header) if header is not None else []


def serve(cache: Cache, opts: ServeOptions) -> None:
    """Run until SIGTERM, Ctrl-C or (with exit_when_idle) idleness."""
    logging.basicConfig(level=logging.INFO, format="launcher serve: %(message)s", stream=sys.stderr, force=True)
    # A guest's boot is hundreds of small NBD reads in a row, each answered by a thread that must take
    # the GIL from whichever fetcher holds it: Python's default 5 ms interval would be paid per read.
    sys.setswitchinterval(SWITCH_INTERVAL)
    DiskServer(cache, opts).run()




def _qemu_uid(request: dict, peer_uid: int | None) -> int | None:
    """Whose NBD socket an open is answered with: the asking launcher's; a root launcher may name the
    user its qemu runs as instead (KubeVirt's qemu user on a session daemon, launcher.runtime.sessiond),
    who then reaches what root opened for it, as it already reads the disks root pulled (node.cache)."""
    wanted = request.get("qemu_uid")
    if peer_uid == 0 and isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0:
        return wanted
    return peer_uid
