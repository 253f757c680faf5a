"""Writing the index (docs/SPEC.md section 3; the layout and the reader are in `sift.format`).

In a local folder a shard is written to a temp name, fsynced, hashed and renamed, so a file with a final name is
always whole; on an object store (`sift.storage.Location`, not `local`) it is serialised in memory, hashed and
put once under its final name. Shards left by a killed build are "orphans" that the next build may reuse (their
rows carry the profile key). Readers see a generation only through manifest.json, written after every file it
lists, so a build in progress is invisible to them.

One writer per index: a flock on `.lock` in a local folder; on an object store, which has no lock, a lease
object `.lock` that the build renews while it runs (`Lease`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sift.errors import SiftError
from sift.format import (BACKEND_META, FORMAT, HISTORY, MANIFEST, MARKER, PROFILE_KEY_META, SHARDS, Manifest,
                         ShardInfo, history, sha256_file)
from sift.storage import Location

LOCK = ".lock"
log = logging.getLogger("sift.build")
_UNCHANGED = "nothing was committed and the previous generation is unchanged"


def _write_failed(index: Location, what: "Path | str", e: OSError) -> SiftError:
    """The one-line error for a write that failed (full disk, read-only folder, a store that refused or did not
    answer): what failed, why, and the fix."""
    return SiftError(f"cannot write {what}: {index.explain(e, 'write')}, and run sift-build again ({_UNCHANGED}; "
                     f"finished shards are reused)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_table(index: Location, table: pa.Table, *, kind: str, profile_key: str = "",
                backend: str = "") -> ShardInfo:
    """Write `table` as an immutable shard named by its content hash. kind: "part" or "errors"."""
    index = Location.of(index)
    meta = {PROFILE_KEY_META: profile_key.encode(), BACKEND_META: backend.encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    if not index.local:
        return _put_table(index, table, kind=kind, backend=backend)
    shards = index.local_path / SHARDS
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
        raise _write_failed(index, shards, e) from None
    return ShardInfo(path=f"{SHARDS}/{final.name}", rows=table.num_rows, bytes=final.stat().st_size,
                     sha256=digest, backend=backend)


def _put_table(index: Location, table: pa.Table, *, kind: str, backend: str) -> ShardInfo:
    """The object-store shard: serialised and hashed in memory (a shard is one batch of rows), then one put under
    its final name, so no temp object and no rename (object stores have no atomic rename)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    digest = hashlib.sha256(data).hexdigest()
    rel = f"{SHARDS}/{kind}-{digest[:24]}.parquet"
    try:
        index.put(rel, data)
    except OSError as e:
        raise _write_failed(index, index.show(rel), e) from None
    return ShardInfo(path=rel, rows=table.num_rows, bytes=len(data), sha256=digest, backend=backend)


def shard_info(index: Location, rel: str) -> ShardInfo:
    """Describe an existing (orphan) shard file."""
    index = Location.of(index)
    meta = pq.read_schema(index.path(rel), filesystem=index.fs).metadata or {}
    rows = pq.read_metadata(index.path(rel), filesystem=index.fs).num_rows
    return ShardInfo(path=rel, rows=rows, bytes=index.size(rel), sha256=index.sha256(rel),
                     backend=meta.get(BACKEND_META, b"").decode())


def prepare_dir(index: Location) -> None:
    """Create a new index folder, or accept an existing one; refuse a folder that holds something else."""
    index = Location.of(index)
    if not index.local:
        return _prepare_prefix(index)
    index_dir = index.local_path
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


def _prepare_prefix(index: Location) -> None:
    """prepare_dir on an object store: the "folder" is a key prefix, created by the first object put under it."""
    try:
        if index.is_file(""):
            raise SiftError(f"--out {index.uri} is an object, not a folder: choose a new or empty prefix")
        if not index.is_file(MARKER):
            if index.files(recursive=True):
                raise SiftError(f"--out {index.uri} is not empty and is not a SIFT index (no {MARKER} marker): "
                                f"choose a new or empty prefix")
            index.put(MARKER, (json.dumps({"format": FORMAT}) + "\n").encode())
    except OSError as e:  # no such bucket, no credentials, no permission, store unreachable
        raise SiftError(f"cannot create the index {index.uri}: {index.explain(e, 'write')}") from None


class _Flock:
    """The local writer lock: held by the kernel until the build ends; nothing to renew or re-check."""

    def check(self) -> None:
        pass


@contextlib.contextmanager
def build_lock(index: Location):
    """Exclusive writer lock: two builders never write one index. Yields an object whose `check()` raises
    SiftError when the lock was lost (only a lease on an object store can be); call it before committing."""
    index = Location.of(index)
    if not index.local:
        lease = Lease(index)
        lease.acquire()
        try:
            yield lease
        finally:
            lease.release()
        return
    index_dir = index.local_path
    try:
        f = open(index_dir / LOCK, "a+")
    except OSError as e:
        raise SiftError(f"cannot write {index_dir / LOCK}: {e.strerror or e}: choose a writable --out "
                        f"({_UNCHANGED})") from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SiftError(f"another sift-build is writing {index_dir} (its .lock is held): wait for it to "
                            f"finish") from None
        try:
            yield _Flock()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class Lease:
    """The writer lock of an index on an object store, which has no flock and no conditional put.

    `.lock` holds the owner's token, host, pid and an expiry LEASE_SECONDS ahead, rewritten every RENEW_SECONDS
    by a thread while the build runs. A build refuses to start while another owner's lease is live; it takes the
    lock over when the lease expired, or at once when the owner ran on this host and its process is gone (a
    killed build), or when the lock is malformed (a record that cannot be parsed guards nothing). After writing
    the lock it reads it back SETTLE_SECONDS later and refuses if another build's token is there, or if the
    store returns something other than what it wrote. Two builds that both read "free" within that window can
    both proceed: this is advisory locking, as good as the store's read-after-write consistency and the hosts'
    clocks, not a mutex."""

    LEASE_SECONDS = 120.0
    RENEW_SECONDS = 30.0
    SETTLE_SECONDS = 0.25

    def __init__(self, index: Location):
        self.index = index
        self.where = index.show(LOCK)
        self.token = uuid.uuid4().hex
        self.renewed = 0.0          # time.time() of the last successful write of the lock
        self.lost = ""              # why the lock is no longer ours ("" while it is)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        expires = time.time() + self.LEASE_SECONDS
        return json.dumps({"owner": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": expires, "expires_utc": _iso(expires)}).encode()

    def _holder(self) -> tuple[dict | None, str]:
        """The lock's record (None when there is no lock object) and what is wrong with it ("" if nothing)."""
        try:
            return _parse_lease(self.index.read_bytes(LOCK))
        except FileNotFoundError:
            return None, ""

    def _ours(self, holder: dict | None, problem: str) -> bool:
        return not problem and holder is not None and holder["owner"] == self.token

    def _write(self) -> None:
        self.index.put(LOCK, self._record())
        self.renewed = time.time()

    def _busy(self, holder: dict) -> SiftError:
        until = holder.get("expires_utc") or _iso(float(holder["expires"]))
        return SiftError(f"another sift-build is writing {self.index.uri} (its lock {self.where} is held by "
                         f"{holder['host']} pid {holder['pid']} until {until} and renewed while it runs): wait "
                         f"for it to finish, or delete the lock object if that build is dead")

    def acquire(self) -> None:
        try:
            holder, problem = self._holder()
            if problem:
                log.warning("the lock %s is malformed (%s): taking it over as an expired lease", self.where,
                            problem)
            elif holder is not None and holder["owner"] != self.token and _live(holder):
                raise self._busy(holder)
            self._write()
            time.sleep(self.SETTLE_SECONDS)
            holder, problem = self._holder()
        except OSError as e:
            raise _write_failed(self.index, self.where, e) from None
        if problem:  # this build's own record came back altered: nothing of this build's writes can be trusted
            with contextlib.suppress(OSError):
                self.index.delete(LOCK)
            raise SiftError(f"the lock {self.where} does not read back as the lease this build wrote ({problem}): "
                            f"the store altered the upload, as S3-compatible servers do with unsigned requests, "
                            f"which are sent when no credentials are found: set AWS_ACCESS_KEY_ID and "
                            f"AWS_SECRET_ACCESS_KEY (or a profile) and run sift-build again ({_UNCHANGED})")
        if holder is None:
            raise SiftError(f"another sift-build is writing {self.index.uri}: the lock {self.where} this build "
                            f"wrote was removed at once: wait for the other build to finish")
        if holder["owner"] != self.token:
            raise self._busy(holder)
        self._thread = threading.Thread(target=self._renew, name="sift-lease", daemon=True)
        self._thread.start()

    def _took(self, problem: str) -> str:
        """Why the lock is not ours any more, as `lost` says it."""
        return f"{self.where} was altered ({problem})" if problem else f"another build took {self.where}"

    def _renew(self) -> None:
        while not self._stop.wait(self.RENEW_SECONDS):
            try:
                holder, problem = self._holder()
                if not self._ours(holder, problem):
                    self.lost = self._took(problem)
                    return
                self._write()
            except OSError:  # the store is unreachable for now: retry; check() refuses once the lease ran out
                continue

    def check(self) -> None:
        """Raise SiftError unless the lock is still ours and its lease has not run out."""
        if not self.lost and time.time() - self.renewed > self.LEASE_SECONDS:
            self.lost = f"{self.where} was not renewed within its lease"
        if not self.lost:
            try:
                holder, problem = self._holder()
            except OSError as e:
                raise _write_failed(self.index, self.where, e) from None
            if not self._ours(holder, problem):
                self.lost = self._took(problem)
        if self.lost:
            raise SiftError(f"this build lost its lock on {self.index.uri} ({self.lost}): {_UNCHANGED} by this "
                            f"build; run sift-build again once the other build has finished")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._ours(*self._holder()):
                self.index.delete(LOCK)
        except OSError:
            pass  # the lease expires on its own


# What a lease record holds, with the JSON types each field must have.
_LEASE_FIELDS = {"owner": (str,), "host": (str,), "pid": (int,), "expires": (int, float)}


def _parse_lease(data: bytes) -> tuple[dict, str]:
    """A lock object's bytes -> (its record, what is wrong with it: "" for a well-formed lease)."""
    try:
        record = json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        return {}, f"not a JSON lease record: it begins {data[:32]!r}"
    if not isinstance(record, dict):
        return {}, f"a JSON {type(record).__name__}, not a lease record"
    for key, kinds in _LEASE_FIELDS.items():
        value = record.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool) or (key == "pid" and not 0 < value < 2**31):
            return record, f"its {key} is {value!r}"
    return record, ""


def _live(holder: dict) -> bool:
    """Whether a well-formed lock record still guards a running build: its lease has not expired, and its owner
    is not a process of this host that is gone."""
    if holder["expires"] <= time.time():
        return False
    if holder["host"] == socket.gethostname():
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # a process of another user has that pid
    return True


def next_generation(index: Location, previous: Manifest | None) -> int:
    """One more than any generation the index ever committed or began to commit: numbers never go back and a
    history file is never overwritten, even when manifest.json was lost."""
    return max([previous.generation if previous else 0, *history(index)]) + 1


def _write_synced(path: Path, data: str, mode: str) -> None:
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit_manifest(index: Location, manifest: Manifest) -> None:
    """Atomically make `manifest` the live generation (and keep a copy in the history). On a failed write
    (full disk) the live manifest.json is untouched and SiftError says so."""
    index = Location.of(index)
    if not index.local:
        return _publish(index, manifest)
    index_dir = index.local_path
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
        raise _write_failed(index, gen_file, e) from None
    try:
        _write_synced(tmp, data, "w")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        gen_file.unlink(missing_ok=True)  # never committed: it is not history
        raise _write_failed(index, index_dir / MANIFEST, e) from None
    os.replace(tmp, index_dir / MANIFEST)
    _fsync_dir(index_dir)


def _publish(index: Location, manifest: Manifest) -> None:
    """commit_manifest on an object store: the history copy `manifests/gen-N.json` (write-once: refused when it
    exists; the lease keeps other writers off), then manifest.json in one put, which is the commit: a reader
    gets the previous object or the new one, whole. A build killed between the two leaves a history file of a
    generation that was never live; readers never see it and the next build numbers past it."""
    data = manifest.to_json().encode()
    gen_rel = f"{HISTORY}/gen-{manifest.generation}.json"
    try:
        if index.exists(gen_rel):
            raise SiftError(f"{index.show(gen_rel)} already exists: another writer bypassed the lock; run "
                            f"sift-build again")
        index.put(gen_rel, data)
    except OSError as e:
        raise _write_failed(index, index.show(gen_rel), e) from None
    try:
        index.put(MANIFEST, data)
    except OSError as e:
        with contextlib.suppress(OSError):
            index.delete(gen_rel)  # never committed: it is not history
        raise _write_failed(index, index.show(MANIFEST), e) from None


def collect_garbage(index: Location, keep: set[str]) -> list[str]:
    """Delete shard files (and temp files) not in `keep` (relative paths). Call under the build lock."""
    index = Location.of(index)
    if not index.local:
        removed = [rel for rel in index.files(SHARDS) if rel not in keep]
        for rel in removed:
            index.delete(rel)
        return removed
    index_dir = index.local_path
    removed = []
    for f in (index_dir / SHARDS).glob("*"):
        rel = f"{SHARDS}/{f.name}"
        if rel not in keep:
            f.unlink(missing_ok=True)
            removed.append(rel)
    for f in index_dir.glob(f".{MANIFEST}.tmp-*"):
        f.unlink(missing_ok=True)
    return removed


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def now_iso() -> str:
    return _iso(time.time())
