"""Writing the index (docs/SPEC.md section 3; the layout and the reader are in `sift.format`).

A shard is written to a temp name, fsynced, hashed and renamed, so a file with a final name is always whole;
shards left by a killed build are "orphans" that the next build may reuse (their rows carry the profile key).
Readers see a generation only through manifest.json, so a build in progress is invisible to them.
"""
from __future__ import annotations

import contextlib
import errno
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
                         ShardInfo, history, sha256_file)

_UNCHANGED = "nothing was committed and the previous generation is unchanged"


def _write_failed(what: Path, e: OSError) -> SiftError:
    """The one-line error for a write that failed (full disk, read-only folder, ...): the problem and the fix."""
    fix = "free some space" if e.errno == errno.ENOSPC else "make the --out folder writable"
    return SiftError(f"cannot write {what}: {e.strerror or e}: {fix} and run sift-build again ({_UNCHANGED}; "
                     f"finished shards are reused)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_table(index_dir: Path, table: pa.Table, *, kind: str, profile_key: str = "", backend: str = "") -> ShardInfo:
    """Write `table` as an immutable shard named by its content hash. kind: "part" or "errors"."""
    shards = index_dir / SHARDS
    meta = {PROFILE_KEY_META: profile_key.encode(), BACKEND_META: backend.encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    tmp = shards / f".tmp-{uuid.uuid4().hex}.parquet"
    try:
        shards.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest = sha256_file(tmp)
        final = shards / f"{kind}-{digest[:24]}.parquet"
        os.replace(tmp, final)
        _fsync_dir(shards)
    except OSError as e:  # pyarrow's write errors are OSErrors too
        tmp.unlink(missing_ok=True)
        raise _write_failed(shards, e) from None
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
    marker = index_dir / MARKER
    try:
        index_dir.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            marker.write_text(json.dumps({"format": FORMAT}) + "\n")
            _fsync_dir(index_dir)
    except OSError as e:  # a read-only file system, a parent that is a file, no permission
        raise SiftError(f"cannot create the index folder {index_dir}: {e.strerror or e}: choose a writable "
                        f"--out") from None


@contextlib.contextmanager
def build_lock(index_dir: Path):
    """Exclusive writer lock: two builders never write one index."""
    try:
        f = open(index_dir / ".lock", "a+")
    except OSError as e:
        raise SiftError(f"cannot write {index_dir / '.lock'}: {e.strerror or e}: choose a writable --out "
                        f"({_UNCHANGED})") from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SiftError(f"another sift-build is writing {index_dir} (its .lock is held): wait for it to "
                            f"finish") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def next_generation(index_dir: Path, previous: Manifest | None) -> int:
    """One more than any generation the index ever committed or began to commit: numbers never go back and a
    history file is never overwritten, even when manifest.json was lost."""
    return max([previous.generation if previous else 0, *history(index_dir)]) + 1


def _write_synced(path: Path, data: str, mode: str) -> None:
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit_manifest(index_dir: Path, manifest: Manifest) -> None:
    """Atomically make `manifest` the live generation (and keep a copy in the history). On a failed write
    (full disk) the live manifest.json is untouched and SiftError says so."""
    data = manifest.to_json()
    tmp = index_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    gen_file = index_dir / HISTORY / f"gen-{manifest.generation}.json"
    try:
        gen_file.parent.mkdir(exist_ok=True)
        _write_synced(gen_file, data, "x")  # "x": a history file is written once, never replaced
    except FileExistsError:
        raise SiftError(f"{gen_file} already exists: another writer bypassed the .lock; run sift-build "
                        f"again") from None
    except OSError as e:
        gen_file.unlink(missing_ok=True)  # a torn copy must not pass for history
        raise _write_failed(gen_file, e) from None
    try:
        _write_synced(tmp, data, "w")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        gen_file.unlink(missing_ok=True)  # never committed: it is not history
        raise _write_failed(index_dir / MANIFEST, e) from None
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
