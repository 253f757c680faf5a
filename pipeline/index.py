"""Writing the index (docs/SPEC.md section 3; the layout and the reader are in `sift.format`).

A shard is written to a temp name, fsynced, hashed and renamed, so a file with a final name is always whole;
shards left by a killed build are "orphans" that the next build may reuse (their rows carry the profile key).
Readers see a generation only through manifest.json, so a build in progress is invisible to them.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sift.errors import SiftError
from sift.format import (BACKEND_META, FORMAT, HISTORY, MANIFEST, MARKER, PROFILE_KEY_META, SHARDS, Manifest,
                         ShardInfo, sha256_file)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def commit_manifest(index_dir: Path, manifest: Manifest) -> None:
    """Atomically make `manifest` the live generation (and keep a copy in the history)."""
    data = manifest.to_json()
    history = index_dir / HISTORY
    history.mkdir(exist_ok=True)
    (history / f"gen-{manifest.generation}.json").write_text(data)
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


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
