"""Failures of the builder and the index format: every one is one line and the right exit code, the manifest is
trusted only inside its folder, history never goes back, and a fault mid-build leaves the previous generation.

One small index is built once (with a relative --out, while the Ray workers run in another working directory)
and copied for each test that damages it; CLI exit codes are checked on the installed console scripts."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from sift import format as fmt
from sift.errors import SiftError, one_line
from sift.format import IndexReader
from sift.pipeline import index as idx
from sift.pipeline.cli import build_main
from sift.pipeline.config import load_config
from sift.pipeline.job import run_build

from .helpers import wiki_texts

BIN = Path(sys.executable).parent


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def assert_one_line_failure(stderr: str, *words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A corpus (two documents and one empty file) and a config; the Ray workers start in another folder."""
    import ray

    root = tmp_path_factory.mktemp("reliability")
    elsewhere = root / "worker-cwd"
    elsewhere.mkdir()
    (elsewhere / "README").write_text("the Ray workers' working directory\n")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"working_dir": str(elsewhere)})
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(wiki_texts(2, step=13)):
        (corpus / f"doc{i}.txt").write_text(text[:150])
    (corpus / "empty.md").write_text(" \n")
    config = root / "c.toml"
    config.write_text('model = "smollm2-135m-instruct"\n[profile]\ntile = 16\n[build]\nshard_rows = 1\n')
    yield root, corpus, config
    ray.shutdown()


@pytest.fixture(scope="module")
def built(workspace):
    """Generation 1 of the corpus, built with the relative --out `index` (item 2 of issue 17)."""
    root, corpus, config = workspace
    cwd = os.getcwd()
    os.chdir(root)
    try:
        stats = run_build(corpus, "index", load_config(config), echo=lambda *_: None)
    finally:
        os.chdir(cwd)
    return root / "index", stats


def copy_index(built, tmp_path) -> Path:
    dst = tmp_path / "index"
    shutil.copytree(built[0], dst)
    return dst


def edit_manifest(index: Path, change) -> None:
    m = json.loads((index / fmt.MANIFEST).read_text())
    change(m)
    (index / fmt.MANIFEST).write_text(json.dumps(m))


# ------------------------------------------------------------------------------------ paths sent to workers


def test_relative_out_builds_although_workers_run_elsewhere(built):
    index, stats = built
    assert (stats.generation, stats.profiled, stats.errors) == (1, 2, 1)
    reader = IndexReader.open(index)
    assert sorted(reader.table(["doc_id"])["doc_id"].to_pylist()) == ["doc0.txt", "doc1.txt"]
    assert not (Path(os.getcwd()) / "index" / fmt.SHARDS).exists()


# ---------------------------------------------------------------------------------- exit codes, one line


def test_out_under_a_regular_file_exits_2(workspace, tmp_path):
    _, corpus, config = workspace
    (tmp_path / "file").write_text("not a folder")
    proc = run_cli("sift-build", corpus, "--out", tmp_path / "file" / "index", "--config", config)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, "cannot create the index folder", "Not a directory")


def test_unwritable_lock_exits_2(workspace, built, tmp_path):
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)
    (index / ".lock").unlink(missing_ok=True)
    (index / ".lock").mkdir()  # opening it for writing fails even for root
    proc = run_cli("sift-build", corpus, "--out", index, "--config", config)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, ".lock", "Is a directory")


def test_read_only_file_system_exits_2(workspace, built, tmp_path, monkeypatch):
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(idx, "open", read_only, raising=False)  # every open of the index writer
    result = CliRunner().invoke(build_main, [str(corpus), "--out", str(index), "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert_one_line_failure(result.stderr, "Read-only file system", ".lock")


def test_unexpected_failure_is_one_line_exit_2(workspace, tmp_path, monkeypatch):
    """Whatever raises, the CLI exits 2 (nothing committed) with one line; 1 stays "committed, with errors"."""
    _, corpus, config = workspace

    def broken(*args, **kwargs):
        raise KeyError("something nobody anticipated")

    monkeypatch.setattr("sift.pipeline.job.run_build", broken)
    result = CliRunner().invoke(build_main, [str(corpus), "--out", str(tmp_path / "i"), "--config", str(config)])
    assert result.exit_code == 2
    assert_one_line_failure(result.stderr, "KeyError", "nothing was committed")


def test_shard_that_is_not_parquet_exits_2(built, tmp_path):
    index = copy_index(built, tmp_path)
    m = json.loads((index / fmt.MANIFEST).read_text())
    shard = index / m["shards"][0]["path"]
    shard.write_bytes(b"these bytes match the manifest's checksum but are not Parquet\n")

    def rehash(m):
        m["shards"][0]["bytes"] = shard.stat().st_size
        m["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()

    edit_manifest(index, rehash)
    proc = run_cli("sift-inspect", index)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, shard.name, "not a readable Parquet file")
    with pytest.raises(SiftError, match="not a readable Parquet file"):
        IndexReader.open(index).table()


INCOMPLETE = {
    "no shards": lambda m: m.pop("shards"),
    "no model.n_layers": lambda m: m["model"].pop("n_layers"),
    "shard without rows": lambda m: m["shards"][0].pop("rows"),
    "documents is a string": lambda m: m.update(documents="two"),
    "corpus is a string": lambda m: m.update(corpus="somewhere"),
    "rope is a list": lambda m: m["model"].update(rope=[1, 2]),
    "generation 0": lambda m: m.update(generation=0),
}


@pytest.mark.parametrize("case", sorted(INCOMPLETE))
def test_incomplete_manifest_is_one_clear_error(built, tmp_path, case):
    from sift.runtime import SiftIndex

    index = copy_index(built, tmp_path)
    edit_manifest(index, INCOMPLETE[case])
    with pytest.raises(SiftError, match="manifest is (incomplete|corrupt)"):
        IndexReader.open(index)
    with pytest.raises(SiftError, match="manifest is (incomplete|corrupt)"):
        SiftIndex.open(index, device="cpu")


@pytest.mark.parametrize("case", ["no shards", "documents is a string"])
def test_incomplete_manifest_inspect_exits_2(built, tmp_path, case):
    index = copy_index(built, tmp_path)
    edit_manifest(index, INCOMPLETE[case])
    proc = run_cli("sift-inspect", index)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, "manifest")


# -------------------------------------------------------------------------- the manifest stays in its folder


@pytest.fixture
def no_file_touched(monkeypatch):
    """Fail if anything hashes or reads a Parquet file while the index is being refused."""
    def forbidden(*args, **kwargs):
        raise AssertionError(f"a listed file was opened: {args}")

    monkeypatch.setattr(fmt, "sha256_file", forbidden)
    monkeypatch.setattr(fmt.pq, "read_table", forbidden)


@pytest.mark.parametrize("path", ["../other/shards/part-0.parquet", "/etc/passwd", "shards/../../x.parquet",
                                  "shards/sub/part-0.parquet", "/no/such/folder/secret.parquet"])
def test_manifest_paths_outside_the_index_are_refused(built, tmp_path, no_file_touched, path):
    index = copy_index(built, tmp_path)
    edit_manifest(index, lambda m: m["shards"][0].update(path=path))
    with pytest.raises(SiftError, match="not shards/<name>.parquet inside the index") as refused:
        IndexReader.open(index)
    assert "missing" not in str(refused.value) and "sha256" not in str(refused.value)  # nor if the file exists


def test_symlinked_shard_leading_outside_is_refused(built, tmp_path, no_file_touched):
    index = copy_index(built, tmp_path)
    outside = tmp_path / "other-index-shard.parquet"
    shard = index / json.loads((index / fmt.MANIFEST).read_text())["shards"][0]["path"]
    shutil.copy(shard, outside)  # a valid shard with the right checksum, but not this index's file
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(SiftError, match="leads outside the index folder"):
        IndexReader.open(index)
    with pytest.raises(SiftError, match="leads outside the index folder"):
        IndexReader.open(index, verify=False)


# --------------------------------------------------------------------------------- history never goes back


def test_deleted_manifest_is_refused_by_readers_and_recovered_by_the_builder(workspace, built, tmp_path):
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)
    gen1 = (index / fmt.HISTORY / "gen-1.json").read_bytes()
    (index / fmt.MANIFEST).unlink()
    proc = run_cli("sift-inspect", index)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, f"cp {index}/manifests/gen-1.json {index}/manifest.json")

    stats = run_build(corpus, index, load_config(config), echo=lambda *_: None)
    assert (stats.generation, stats.profiled, stats.reused) == (2, 0, 2)
    assert (index / fmt.HISTORY / "gen-1.json").read_bytes() == gen1
    assert IndexReader.open(index).generation == 2


def test_generation_skips_history_a_killed_commit_left(built, tmp_path):
    index = copy_index(built, tmp_path)
    previous = IndexReader.open(index).manifest
    (index / fmt.HISTORY / "gen-2.json").write_text("{ begun, never committed")
    assert idx.next_generation(index, previous) == 3
    with pytest.raises(SiftError, match="already exists"):
        idx.commit_manifest(index, previous)  # generation 1: its history file is never rewritten


# ------------------------------------------------------------------------------------- a disk that fills


class _FullDisk:
    """pyarrow.parquet as the index writer sees it on a full disk."""

    def __getattr__(self, name):
        return getattr(pq, name)

    @staticmethod
    def write_table(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 torn")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))


def _failing_write(path, data, mode):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_disk_full_keeps_the_previous_generation(workspace, built, tmp_path, monkeypatch, where):
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)
    before = (index / fmt.MANIFEST).read_bytes()
    if where == "shard":  # the errors table is written by the driver (the empty file is an error row)
        monkeypatch.setattr(idx, "pq", _FullDisk())
    else:
        monkeypatch.setattr(idx, "_write_synced", _failing_write)
    result = CliRunner().invoke(build_main, [str(corpus), "--out", str(index), "--config", str(config), "-q"])
    assert result.exit_code == 2, result.output
    assert_one_line_failure(result.stderr, "No space left on device", "free some space")
    assert (index / fmt.MANIFEST).read_bytes() == before
    assert sorted(p.name for p in (index / fmt.HISTORY).iterdir()) == ["gen-1.json"]
    assert not list(index.glob(".*.tmp-*")) and not list((index / fmt.SHARDS).glob(".tmp-*"))
    assert IndexReader.open(index).generation == 1

    monkeypatch.undo()
    stats = run_build(corpus, index, load_config(config), echo=lambda *_: None)
    assert (stats.generation, stats.reused, stats.profiled) == (2, 2, 0)


def test_worker_error_reaches_the_user_as_one_line(workspace):
    import ray

    @ray.remote
    def fill_disk():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/index/shards/.tmp-1.parquet")

    with pytest.raises(Exception) as raised:
        ray.get(fill_disk.remote())
    assert "\n" in str(raised.value)  # Ray's own message is a traceback
    assert one_line(raised.value) == "OSError: No space left on device: /index/shards/.tmp-1.parquet"


# ---------------------------------------------------------------------------------------- model fingerprint


def test_fingerprint_sees_new_bytes_with_the_same_size_and_mtime(tmp_path, monkeypatch):
    from sift import model as sift_model

    monkeypatch.setenv("SIFT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    weights.write_bytes(b"A" * 4096)
    old = os.stat(weights)
    time.sleep(0.05)  # the rewrite lands on a later timestamp tick
    first = sift_model.fingerprint(folder)
    # The memo keeps only files older than its racy window; make this one count as old.
    monkeypatch.setattr(sift_model, "_RACY_NS", 0)
    assert sift_model.fingerprint(folder) == first
    assert json.loads((tmp_path / "cache" / "fingerprints.json").read_text())

    weights.write_bytes(b"B" * 4096)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert os.stat(weights).st_size == old.st_size and os.stat(weights).st_mtime_ns == old.st_mtime_ns
    second = sift_model.fingerprint(folder)
    assert second != first
    weights.write_bytes(b"A" * 4096)
    assert sift_model.fingerprint(folder) == first


# ----------------------------------------------------------------------------- a profiling actor killed


def _actor_pids() -> list[int]:
    """Processes of this machine running a profiling actor (Ray titles them after the class)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"ProfileShardWriter" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_profiling_actor_killed_mid_build(workspace, tmp_path):
    import signal
    import threading

    _, _, config = workspace
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = wiki_texts(6, step=7)
    for i, text in enumerate(texts):
        (corpus / f"d{i}.txt").write_text(text[:300])
    index = tmp_path / "index"
    outcome = {}

    def build():
        try:
            outcome["stats"] = run_build(corpus, index, load_config(config), echo=lambda *_: None)
        except SiftError as e:
            outcome["error"] = e

    thread = threading.Thread(target=build)
    thread.start()
    killed = []
    deadline = time.time() + 300
    while thread.is_alive() and not killed and time.time() < deadline:
        if list((index / fmt.SHARDS).glob("part-*.parquet")):  # an actor is mid-way through the documents
            for pid in _actor_pids():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.2)
    thread.join(timeout=300)
    assert killed, "no profiling actor was seen running"
    if "error" in outcome:  # Ray gave up on the actor: one line, and the next build resumes
        assert "\n" not in str(outcome["error"])
        outcome["stats"] = run_build(corpus, index, load_config(config), echo=lambda *_: None)
    ids = IndexReader.open(index).table(["doc_id"])["doc_id"].to_pylist()
    assert sorted(ids) == [f"d{i}.txt" for i in range(len(texts))]


# ------------------------------------------------------------------ repair, a folder that refuses, leftovers


def _ray_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def _ray_logs() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def test_corrupt_shard_is_rebuilt_and_quiet_keeps_ray_lines_in_its_logs(workspace, built, tmp_path):
    """The repair `sift-inspect` advises works: with a shard's bytes replaced by random ones, `sift-build -q`
    commits, profiling again exactly the documents of that shard, and says so; Ray's native error lines (the
    core worker's about actor restarts) stay in Ray's log files, off a quiet terminal."""
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)
    before = {r["doc_id"]: r for r in IndexReader.open(index).table().to_pylist()}
    bad = json.loads((index / fmt.MANIFEST).read_text())["shards"][0]
    lost = pq.read_table(index / bad["path"], columns=["doc_id"])["doc_id"].to_pylist()
    (index / bad["path"]).write_bytes(os.urandom(5000))  # head -c 5000 /dev/urandom > shard
    refused = run_cli("sift-inspect", index)
    assert refused.returncode == 2 and "rebuild the index" in refused.stderr

    proc = subprocess.Popen([str(BIN / "sift-build"), str(corpus), "--out", str(index), "--config", str(config),
                             "-q", "--ray-address", _ray_address()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]  # committed; empty.md is still an error row
    assert out.startswith("committed generation 2: 2 documents (profiled 1, reused 1, deleted 0), 1 errors")
    assert f"unreadable shard(s) of generation 1 skipped: {bad['path']} (1 documents: its bytes do not match" in out
    warnings = err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("WARNING sift.build: shard "), err[-3000:]
    assert bad["path"] in warnings[0] and "profiled again" in warnings[0]

    reader = IndexReader.open(index)
    after = {r["doc_id"]: r for r in reader.table().to_pylist()}
    assert reader.generation == 2 and sorted(after) == sorted(before) == ["doc0.txt", "doc1.txt"]
    for doc_id in before:
        assert after[doc_id]["content_hash"] == before[doc_id]["content_hash"]
        if doc_id not in lost:
            assert after[doc_id]["la_bits"] == before[doc_id]["la_bits"]
    assert reader.errors()["doc_id"].to_pylist() == ["empty.md"]
    assert bad["path"] in reader.manifest.last_build["note"]

    # Under -q the driver's native stderr (Ray's core_worker lines) went to Ray's log folder, not the terminal.
    assert "core_worker" not in err
    assert (_ray_logs() / f"sift-build-{proc.pid}.err").exists()


@contextlib.contextmanager
def _read_only(folder: Path):
    """`folder` made unwritable: chmod for a user, the immutable attribute for root (whom chmod does not stop)."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        undo = lambda: folder.chmod(mode)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)]).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    else:
        pytest.skip("root without `chattr +i` cannot make a folder read-only")
    try:
        try:
            (folder / "probe").touch()
            pytest.skip(f"{folder} stayed writable")
        except OSError:
            pass
        yield
    finally:
        undo()


def test_unwritable_out_names_the_folder_and_the_error(workspace, built, tmp_path):
    _, corpus, config = workspace
    index = copy_index(built, tmp_path)
    more = tmp_path / "corpus"
    shutil.copytree(corpus, more)
    (more / "new.txt").write_text(wiki_texts(3, step=13)[2][:150])  # one document to profile
    with _read_only(index / fmt.SHARDS):
        proc = run_cli("sift-build", more, "--out", index, "--config", config, "-q", "--ray-address",
                       _ray_address())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, f"cannot write {index / fmt.SHARDS}", "and run sift-build again")
    assert "Operation not permitted" in proc.stderr or "Permission denied" in proc.stderr
    assert IndexReader.open(index).generation == 1


def _session(sid: int) -> list[str]:
    """'pid command' of every live (not zombie) process of the session `sid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        state, _, _, session = stat[stat.rindex(")") + 2:].split()[:4]
        if int(session) == sid and state != "Z":
            found.append(f"{entry.name} {command[:120]}")
    return found


def test_killed_build_leaves_no_ray_process(workspace, tmp_path):
    """kill -9 of a sift-build that started its own Ray while it profiles: within seconds no process of its
    session is left (Ray's dashboard and runtime-env agents used to stay, ignoring SIGTERM)."""
    _, _, config = workspace
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(wiki_texts(6, step=5)):
        (corpus / f"d{i}.txt").write_text(text[:300])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([str(BIN / "sift-build"), str(corpus), "--out", str(tmp_path / "index"), "--config",
                             str(config), "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # its session id is its pid, and every Ray process's
    try:
        deadline = time.time() + 300
        while not list((tmp_path / "index" / fmt.SHARDS).glob("part-*.parquet")):
            assert proc.poll() is None and time.time() < deadline, "the build wrote no shard in time"
            time.sleep(0.2)
        assert any("ray::" in p for p in _session(proc.pid))  # Ray runs, actors included
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 30
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
        assert not _session(proc.pid)
    finally:
        for line in _session(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_reading_ahead_stops_when_the_build_stops_reading():
    """A build that stops early (an actor's error, an interrupt) must not leave the thread that reads the corpus
    ahead running: one left inside Ray's client when the process exits can crash the process."""
    from sift.pipeline.plan import _Ahead

    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    ahead = _Ahead(endless(), depth=2)
    items = iter(ahead)
    assert [next(items), next(items)] == [0, 1]
    deadline = time.monotonic() + 10
    while len(made) < 4 and time.monotonic() < deadline:   # the thread fills the queue and waits for room
        time.sleep(0.01)
    ahead.close()
    assert not ahead.thread.is_alive()
    n = len(made)
    time.sleep(0.3)
    assert len(made) == n                                  # nothing more is read once closed

    failing = _Ahead(iter([1, 2]), depth=1)
    failing.close()                                       # closed before anything was taken: still stops
    assert not failing.thread.is_alive()
