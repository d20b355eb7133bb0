"""The node-wide index of chunks the cache holds: (hash name, hex of a chunk's uncompressed bytes)
-> places (a file relative to the cache root, offset, length), in `<cache>/chunks/index.sqlite`.

SQLite in WAL mode, so pulls and disk servers in other processes add and look up at once and `gc`
forgets files while they do; writers wait for each other (busy timeout) instead of failing. The index
is only a hint: whoever reads a place hashes what it read (launcher.chunks.source), so a stale or
wrong row costs a fetch, never a wrong byte. It can therefore be thrown away: one that is missing or
that SQLite cannot read is rebuilt from the disks the cache holds (`rebuild`), from the hashes
recorded beside each disk when it was installed (CHUNKS_FILE), and by hashing the disk where none were.

A disk is found by the chunks new TOCs name: cut where their content says (diskkit.layers.chunkcut)
and hashed with BLAKE3 (REBUILD_HASH). A disk whose TOC cut it otherwise (fixed chunks, TOC v2 or
older, or sha256 names) is hashed that way too, once, beside its TOC's record (`records_for`): an
image rebuilt with content-defined chunks then finds it as one built before finds it by its TOC.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from diskkit.layers import chunkcut, lazytoc
from diskkit.streams.pieceread import PieceReader

DIR = "chunks"
DB = "index.sqlite"
CHUNKS_FILE = "chunks.json"  # beside a cached disk: {"hash", "chunkSize", "size", "hexes", "lengths"?} (Record.render)
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


@dataclass(frozen=True)
class Record:
    """One way a file is cut into chunks, and each chunk's hash (hex) under `hash_name`."""

    hash_name: str
    hexes: tuple[str, ...]
    grid: lazytoc.Grid

    @property
    def content_defined(self) -> bool:
        return self.grid.lengths is not None

    def places(self, relpath: str):
        for i, hexdigest in enumerate(self.hexes):
            start, end = self.grid.range(i)
            yield self.hash_name, hexdigest, relpath, start, end - start

    def render(self) -> bytes:
        """What CHUNKS_FILE holds (lengths only for content-defined chunks, as TOC v3 lists them)."""
        obj = {"hash": self.hash_name, "chunkSize": self.grid.chunk_size, "size": self.grid.size, "hexes": list(self.hexes)}
        if self.grid.lengths is not None:
            obj["lengths"] = list(self.grid.lengths)
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> "Record":
        """The record CHUNKS_FILE holds; ValueError (or KeyError, TypeError) when it is not one."""
        obj = json.loads(data)
        lengths = obj.get("lengths")
        grid = lazytoc.Grid(int(obj["size"]), int(obj["chunkSize"]), tuple(int(n) for n in lengths) if lengths is not None else None)
        record = cls(str(obj["hash"]), tuple(map(str, obj["hexes"])), grid)
        if grid.size < 0 or grid.chunk_size <= 0 or len(record.hexes) != grid.count:
            raise ValueError(f"{len(record.hexes)} chunk hashes for {grid.size} bytes in {grid.chunk_size}-byte chunks")
        if lengths is not None and (sum(grid.lengths) != grid.size or not all(0 < n <= grid.chunk_size for n in grid.lengths)):
            raise ValueError("chunk lengths that do not add up to the file")
        return record


def of_toc(toc) -> Record | None:
    """The record a lazy TOC (or a disk server layout, which carries its fields) gives its disk: its chunks by content."""
    hashes = toc.content_hashes
    return Record(hashes[0], tuple(hashes[1]), toc.grid) if hashes is not None else None


def hash_file(path: Path, hash_name: str = REBUILD_HASH) -> Record:
    """A file cut as `diskkit build` cuts a disk of its size, each chunk hashed: one pass, flat memory."""
    size = path.stat().st_size
    cuts = chunkcut.params_for(size)
    hexes, lengths = [], []
    piece = cuts.max if cuts is not None else lazytoc.chunk_size_for(size)
    reader = PieceReader(path, piece, 4, size)
    try:
        pieces = iter(reader)
        chunks = chunkcut.cut(pieces, cuts) if cuts is not None else ((view, release) for view, release in pieces)
        for data, release in chunks:
            hexes.append(lazytoc.content_hash(hash_name, data))
            lengths.append(len(data))
            if release is not None:
                release()
    finally:
        reader.close()
    grid = lazytoc.Grid(size, piece, tuple(lengths) if cuts is not None else None)
    return Record(hash_name, tuple(hexes), grid)


def records_for(path: Path, recorded: Record | None) -> list[Record]:
    """What a cached disk is indexed by: `recorded` (its TOC's), and the disk cut and hashed as new
    TOCs cut and name chunks when `recorded` is not that already."""
    if recorded is not None and recorded.hash_name == REBUILD_HASH and (recorded.content_defined or chunkcut.params_for(recorded.grid.size) is None):
        return [recorded]
    return [*([recorded] if recorded is not None else []), hash_file(path)]


class ChunkIndex:
    """`cache` is anything with a `root` (launcher.node.cache.Cache); one instance may be shared by threads."""

    def __init__(self, cache):
        self.root = Path(cache.root)
        self.dir = self.root / DIR
        self.path = self.dir / DB
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    # --- the connection ----------------------------------------------------------------------

    def _connect(self, adding: str | None = None) -> sqlite3.Connection:
        """The connection; a fresh file is rebuilt from the cache's disks first, but for the one at
        `adding`, which the caller is about to record (a node's first pull would cut or read its
        chunks twice)."""
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
            self._rebuild_locked(adding)
        return db

    def _run(self, work, adding: str | None = None):
        """`work(db)` under the lock; an index SQLite cannot read is thrown away, rebuilt, and asked again."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    db = self._db or self._connect(adding)
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

    def add_file(self, relpath: str, *records: Record) -> None:
        """Record that the file at `relpath` (cache-relative) holds these chunks, in place of what was
        recorded for it under the same hash names (a file may be cut and hashed several ways)."""
        self._run(lambda db: self._add(db, relpath, records), adding=relpath)

    @staticmethod
    def _add(db: sqlite3.Connection, relpath: str, records) -> None:
        if Path(relpath).is_absolute() or ".." in Path(relpath).parts:
            raise ValueError(f"{relpath}: chunk places are paths inside the cache")
        for record in records:
            if len(record.hexes) != record.grid.count:
                raise ValueError(f"{relpath}: {len(record.hexes)} chunk hashes for {record.grid.size} bytes in {record.grid.count} chunks")
        db.execute("BEGIN IMMEDIATE")
        try:
            for hash_name in {r.hash_name for r in records}:
                db.execute("DELETE FROM places WHERE path = ? AND hash = ?", (relpath, hash_name))
            for record in records:
                db.executemany("INSERT OR REPLACE INTO places VALUES (?, ?, ?, ?, ?)", record.places(relpath))
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

    def _rebuild_locked(self, adding: str | None = None) -> None:
        db = self._db
        for disk in sorted((self.root / "disks" / "sha256").glob("*/*/disk.img")):
            relpath = str(disk.relative_to(self.root))
            if relpath == adding:
                continue
            try:
                self._add(db, relpath, records_for(disk, _recorded(disk.parent / CHUNKS_FILE, disk)))
            except OSError:
                continue  # removed meanwhile (gc)


def _recorded(path: Path, disk: Path) -> Record | None:
    """The record kept beside `disk`, or None when missing or not for this file."""
    try:
        record = Record.parse(path.read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if record.grid.size == disk.stat().st_size else None
