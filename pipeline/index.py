"""The index on disk (SPEC section 3): immutable Parquet shards and one atomically replaced manifest.

    INDEX/
      .sift-index            marker: this folder is a SIFT index (written before anything else)
      .lock                  held (flock) by the one builder writing the folder
      manifest.json          the only file ever replaced: temp file, fsync, rename, fsync(dir)
      manifests/gen-N.json   a copy of every committed manifest (history; recovery from a bad manifest.json)
      shards/part-<sha>.parquet     document rows, named by the sha256 of their bytes, never modified
      shards/errors-<sha>.parquet   the errors table of a generation (doc_id, source, reason)

A shard is written to a temp name, fsynced, hashed and renamed, so a file with a final name is always whole;
shards left by a killed build are "orphans" that the next build may reuse (their rows carry the profile key).
Readers see a generation only through manifest.json, so a build in progress is invisible to them.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sift.errors import SiftError

FORMAT = "sift-index"
FORMAT_VERSION = 1
MARKER = ".sift-index"
MANIFEST = "manifest.json"
SHARDS = "shards"
PROFILE_KEY_META = b"sift.profile_key"
BACKEND_META = b"sift.backend"

DOCS_SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("content_hash", pa.string()),
    ("n_tokens", pa.int32()),
    ("la_bits", pa.binary()),
    ("ca_bits", pa.binary()),
    ("source", pa.string()),
    ("la_density", pa.list_(pa.float32())),  # per layer, mean over heads of the fraction of LA tiles kept
    ("ca_density", pa.list_(pa.float32())),  # per layer, mean over heads of the fraction of CA pages kept
])
ERRORS_SCHEMA = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("reason", pa.string())])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    path: str      # relative to the index root
    rows: int
    bytes: int
    sha256: str
    backend: str   # "torch", "triton" or "" for the errors table

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def write_table(index_dir: Path, table: pa.Table, *, kind: str, profile_key: str = "", backend: str = "") -> ShardInfo:
    """Write `table` as an immutable shard named by its content hash. kind: "part" or "errors"."""
    shards = index_dir / SHARDS
    shards.mkdir(parents=True, exist_ok=True)
    meta = {PROFILE_KEY_META: profile_key.encode(), BACKEND_META: backend.encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    tmp = shards / f".tmp-{uuid.uuid4().hex}.parquet"
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = sha256_file(tmp)
    final = shards / f"{kind}-{digest[:24]}.parquet"
    os.replace(tmp, final)
    _fsync_dir(shards)
    return ShardInfo(path=f"{SHARDS}/{final.name}", rows=table.num_rows, bytes=final.stat().st_size,
                     sha256=digest, backend=backend)


def shard_info(index_dir: Path, rel: str) -> ShardInfo:
    """Describe an existing (orphan) shard file."""
    path = index_dir / rel
    meta = pq.read_schema(path).metadata or {}
    return ShardInfo(path=rel, rows=pq.read_metadata(path).num_rows, bytes=path.stat().st_size,
                     sha256=sha256_file(path), backend=meta.get(BACKEND_META, b"").decode())


def prepare_dir(index_dir: Path) -> None:
    """Create a new index folder, or accept an existing one; refuse a folder that holds something else."""
    if index_dir.exists() and not index_dir.is_dir():
        raise SiftError(f"--out {index_dir} is a file, not a folder: choose a new or empty folder")
    if index_dir.is_dir() and any(index_dir.iterdir()) and not (index_dir / MARKER).exists():
        raise SiftError(f"--out {index_dir} is not empty and is not a SIFT index (no {MARKER} marker): "
                        f"choose a new or empty folder")
    index_dir.mkdir(parents=True, exist_ok=True)
    marker = index_dir / MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"format": FORMAT}) + "\n")
        _fsync_dir(index_dir)


@contextlib.contextmanager
def build_lock(index_dir: Path):
    """Exclusive writer lock: two builders never write one index."""
    with open(index_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SiftError(f"another sift-build is writing {index_dir} (its .lock is held): wait for it to "
                            f"finish") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_manifest(index_dir: Path) -> dict | None:
    """The committed manifest, None for an index with no generation yet; SiftError naming a bad one."""
    path = index_dir / MANIFEST
    if not path.exists():
        if not (index_dir / MARKER).exists():
            raise SiftError(f"{index_dir} is not a SIFT index (no {MANIFEST}): build one with `sift-build`")
        return None
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SiftError(f"{path} is corrupt ({e}): restore it from {index_dir}/manifests/gen-N.json "
                        f"(the last good copy) or rebuild the index") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SiftError(f"{path} is not a SIFT manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r}): rebuild the index")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise SiftError(f"{path} has format_version {manifest.get('format_version')!r}; this version reads "
                        f"{FORMAT_VERSION}: rebuild the index or upgrade sift")
    return manifest


def commit_manifest(index_dir: Path, manifest: dict) -> None:
    """Atomically make `manifest` the live generation."""
    data = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    history = index_dir / "manifests"
    history.mkdir(exist_ok=True)
    (history / f"gen-{manifest['generation']}.json").write_text(data)
    tmp = index_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, index_dir / MANIFEST)
    _fsync_dir(index_dir)


def collect_garbage(index_dir: Path, keep: set[str]) -> list[str]:
    """Delete shard files (and temp files) not in `keep` (relative paths). Call under the build lock."""
    removed = []
    for f in (index_dir / SHARDS).glob("*"):
        rel = f"{SHARDS}/{f.name}"
        if rel not in keep:
            f.unlink(missing_ok=True)
            removed.append(rel)
    for f in index_dir.glob(f".{MANIFEST}.tmp-*"):
        f.unlink(missing_ok=True)
    return removed


class IndexReader:
    """Read-only view of one committed generation, with checksums verified (plain pyarrow underneath)."""

    def __init__(self, index_dir: Path, manifest: dict):
        self.root = index_dir
        self.manifest = manifest

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> "IndexReader":
        root = Path(path)
        if not root.is_dir():
            raise SiftError(f"index {root} does not exist: build it with `sift-build CORPUS --out {root}`")
        manifest = read_manifest(root)
        if manifest is None:
            raise SiftError(f"index {root} has no committed generation yet (a first build is running or was "
                            f"killed): run `sift-build` to finish it")
        reader = cls(root, manifest)
        if verify:
            reader.verify()
        return reader

    @property
    def generation(self) -> int:
        return self.manifest["generation"]

    def _entries(self) -> list[dict]:
        entries = list(self.manifest["shards"])
        if self.manifest.get("errors"):
            entries.append(self.manifest["errors"])
        return entries

    def verify(self) -> None:
        for e in self._entries():
            path = self.root / e["path"]
            if not path.is_file():
                raise SiftError(f"shard {path} listed in the manifest is missing: rebuild the index")
            if path.stat().st_size != e["bytes"] or sha256_file(path) != e["sha256"]:
                raise SiftError(f"shard {path} is corrupt (sha256 does not match the manifest): rebuild the "
                                f"index (`sift-build` re-profiles its documents)")

    def table(self, columns: list[str] | None = None) -> pa.Table:
        """All document rows of this generation."""
        tables = [pq.read_table(self.root / s["path"], columns=columns) for s in self.manifest["shards"]]
        if not tables:
            schema = DOCS_SCHEMA if columns is None else pa.schema([DOCS_SCHEMA.field(c) for c in columns])
            return schema.empty_table()
        return pa.concat_tables([t.replace_schema_metadata(None) for t in tables])

    def errors(self) -> pa.Table:
        e = self.manifest.get("errors")
        if not e:
            return ERRORS_SCHEMA.empty_table()
        return pq.read_table(self.root / e["path"]).replace_schema_metadata(None)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
