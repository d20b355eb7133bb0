"""The node-wide index of chunks the cache holds: (hash name, hex of a chunk's uncompressed bytes)
-> places (a file relative to the cache root, offset, length), in `<cache>/chunks/index.sqlite`.

SQLite in WAL mode, so pulls and disk servers in other processes add and look up at once and `gc`
forgets files while they do; writers wait for each other (busy timeout) instead of failing. The index
is only a hint: whoever reads a place hashes what it read (launcher.chunks.source), so a stale or
wrong row costs a fetch, never a wrong byte. It can therefore be thrown away: one that is missing or
that SQLite cannot read is rebuilt from the disks the cache holds (`rebuild`), from the hashes
recorded beside each disk when it was installed (CHUNKS_FILE), or by hashing the disk where none were
(and where they were sha256, as older TOCs name chunks: new ones use BLAKE3, REBUILD_HASH).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from diskkit.layers import lazytoc

DIR = "chunks"
DB = "index.sqlite"
CHUNKS_FILE = "chunks.json"  # beside a cached disk: {"hash", "chunkSize", "size", "hexes"} (record_for)
REBUILD_HASH = "blake3"  # what a disk with no recorded hashes is hashed with: what new TOCs name chunks by
MAX_PLACES = 8  # places returned per chunk: an all-zero chunk may be in thousands
# Reusing held chunks tells a registry which chunks the node holds: it is asked only for the others.
REUSE_ENV = "DISKKIT_REUSE_CHUNKS"
BUSY_MS = 60_000
SCHEMA = """
CREATE TABLE IF NOT EXISTS places (hash TEXT NOT NULL, hex TEXT NOT NULL, path TEXT NOT NULL, offset INTEGER NOT NULL,
                                   length INTEGER NOT NULL, PRIMARY KEY (hash, hex, path, offset)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS places_by_path ON places (path);
"""


@dataclass(frozen=True)
class Place:
    path: str  # relative to the cache root
    offset: int
    length: int


def reuse_allowed() -> bool:
    """Whether pulls and lazy exports may take chunks from the node's cache: yes unless REUSE_ENV is
    0, false, no or off. Without reuse every layer is fetched whole (pulls) or every chunk from the
    registry (lazy exports), and the registry's range requests say nothing of what the node holds."""
    return os.environ.get(REUSE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def record_for(hash_name: str, hexes: tuple[str, ...] | list[str], chunk_size: int, size: int) -> bytes:
    """What CHUNKS_FILE holds for a disk whose chunk i (of `chunk_size` bytes) hashes to hexes[i]."""
    return json.dumps({"hash": hash_name, "chunkSize": chunk_size, "size": size, "hexes": list(hexes)}, separators=(",", ":")).encode()


def hash_file(path: Path, hash_name: str = REBUILD_HASH) -> tuple[tuple[str, ...], int, int]:
    """(hexes, chunk size, size) of a file cut as a lazy TOC of its size would cut it."""
    size = path.stat().st_size
    chunk_size = lazytoc.chunk_size_for(size)
    hexes = []
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk_size):
            hexes.append(lazytoc.content_hash(hash_name, data))
    return tuple(hexes), chunk_size, size


class ChunkIndex:
    """`cache` is anything with a `root` (launcher.node.cache.Cache); one instance may be shared by threads."""

    def __init__(self, cache):
        self.root = Path(cache.root)
        self.dir = self.root / DIR
        self.path = self.dir / DB
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    # --- the connection ----------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        fresh = not self.path.exists()
        db = sqlite3.connect(self.path, timeout=BUSY_MS / 1000, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout={BUSY_MS}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a lost tail after a power cut only loses hints
            db.executescript(SCHEMA)
            db.execute("SELECT count(*) FROM places LIMIT 1").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        self._db = db
        if fresh:
            self._rebuild_locked()
        return db

    def _run(self, work):
        """`work(db)` under the lock; an index SQLite cannot read is thrown away, rebuilt, and asked again."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    db = self._db or self._connect()
                    return work(db)
                except sqlite3.DatabaseError as exc:
                    # Only a file SQLite cannot read as a database goes ("file is not a database",
                    # "malformed"); a busy or unwritable one is an error, not a reason to throw it away.
                    if attempt or isinstance(exc, (sqlite3.OperationalError, sqlite3.IntegrityError, sqlite3.ProgrammingError)):
                        raise
                    self._discard()

    def _discard(self) -> None:
        """A corrupt index: closed and deleted (with its WAL), to be made afresh."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self.path}{suffix}")

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # --- the API -----------------------------------------------------------------------------

    def add_file(self, relpath: str, hash_name: str, hexes, chunk_size: int, size: int) -> None:
        """Record that chunk i of the file at `relpath` (cache-relative) hashes to hexes[i] under
        `hash_name`, in place of what was recorded for it under that name (a file may have several)."""
        self._run(lambda db: self._add(db, relpath, hash_name, hexes, chunk_size, size))

    @staticmethod
    def _add(db: sqlite3.Connection, relpath: str, hash_name: str, hexes, chunk_size: int, size: int) -> None:
        if Path(relpath).is_absolute() or ".." in Path(relpath).parts:
            raise ValueError(f"{relpath}: chunk places are paths inside the cache")
        if len(hexes) != -(-size // chunk_size):
            raise ValueError(f"{relpath}: {len(hexes)} chunk hashes for {size} bytes in {chunk_size}-byte chunks")
        rows = ((hash_name, hexes[i], relpath, i * chunk_size, min(chunk_size, size - i * chunk_size)) for i in range(len(hexes)))
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM places WHERE path = ? AND hash = ?", (relpath, hash_name))
            db.executemany("INSERT OR REPLACE INTO places VALUES (?, ?, ?, ?, ?)", rows)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def lookup(self, hash_name: str, hexdigest: str) -> list[Place]:
        rows = self._run(lambda db: db.execute("SELECT path, offset, length FROM places WHERE hash = ? AND hex = ? LIMIT ?",
                                               (hash_name, hexdigest, MAX_PLACES)).fetchall())
        return [Place(*row) for row in rows]

    def forget(self, relpath: str) -> None:
        """The file at `relpath` is gone (gc) or no longer what it was: none of its places are kept."""
        self._run(lambda db: db.execute("DELETE FROM places WHERE path = ?", (relpath,)))

    def forget_under(self, relpath: str) -> None:
        """Every file at or below `relpath` is gone (a disk entry or lazy export that gc removed)."""
        prefix = relpath.rstrip("/") + "/"
        self._run(lambda db: db.execute("DELETE FROM places WHERE path = ? OR substr(path, 1, ?) = ?",
                                        (relpath, len(prefix), prefix)))

    def forget_place(self, hash_name: str, hexdigest: str, place: Place) -> None:
        """One place found not to hold its chunk any more (launcher.chunks.source)."""
        self._run(lambda db: db.execute("DELETE FROM places WHERE hash = ? AND hex = ? AND path = ? AND offset = ?",
                                        (hash_name, hexdigest, place.path, place.offset)))

    def empty(self) -> bool:
        """Nothing recorded: a pull has no chunk to look for, so no reason to read a TOC ahead. An
        index not made yet on a cache with no disk is not made for the question (a pull that fails
        on a fresh node leaves nothing behind)."""
        if self._db is None and not self.path.exists() and not any((self.root / "disks" / "sha256").glob("*/*/disk.img")):
            return True
        return self._run(lambda db: db.execute("SELECT 1 FROM places LIMIT 1").fetchone()) is None

    def paths(self) -> list[str]:
        return [row[0] for row in self._run(lambda db: db.execute("SELECT DISTINCT path FROM places").fetchall())]

    def rebuild(self) -> int:
        """Made again from the cache's disks; returns how many files it holds."""
        with self._lock:
            self._discard()
            self._connect()  # a fresh file: rebuilt there
            return len(self._db.execute("SELECT DISTINCT path FROM places").fetchall())

    def _rebuild_locked(self) -> None:
        db = self._db
        for disk in sorted((self.root / "disks" / "sha256").glob("*/*/disk.img")):
            relpath = str(disk.relative_to(self.root))
            try:
                found = _recorded(disk.parent / CHUNKS_FILE, disk)
                if found is not None:
                    self._add(db, relpath, *found)
                if found is None or found[0] != REBUILD_HASH:  # older TOCs' sha256: BLAKE3 too, as new TOCs name chunks
                    self._add(db, relpath, REBUILD_HASH, *hash_file(disk))
            except OSError:
                continue  # removed meanwhile (gc)


def _recorded(path: Path, disk: Path):
    """(hash, hexes, chunk size, size) recorded beside `disk`, or None when missing or not for this file."""
    try:
        obj = json.loads(path.read_bytes())
        found = (str(obj["hash"]), tuple(map(str, obj["hexes"])), int(obj["chunkSize"]), int(obj["size"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None
    if found[3] != disk.stat().st_size or found[2] <= 0 or len(found[1]) != -(-found[3] // found[2]):
        return None
    return found
