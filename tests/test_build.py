"""The builder end to end on a small real corpus with the real SmolLM2 weights: read-back with plain pyarrow
and with datasets, incremental re-indexing, bad input, crash safety (SIGKILL) and a concurrent reader."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sift.errors import SiftError
from sift.pipeline.config import load_config
from sift.format import IndexReader
from sift.pipeline.job import run_build

from .helpers import wiki_texts

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def write_config(path: Path, **build) -> Path:
    lines = ['model = "smollm2-135m-instruct"', "[profile]", "tile = 16", "[build]"]
    lines += [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in build.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_corpus(root: Path, n: int, chars: int = 160) -> list[str]:
    """n short real Wikipedia documents as .txt files (doc_id = file name)."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i, text in enumerate(wiki_texts(n, step=11)):
        name = f"doc{i:02d}.txt"
        (root / name).write_text(text[:chars])
        names.append(name)
    return names


def rows_by_id(index: Path) -> dict:
    t = IndexReader.open(index).table()
    ids = t["doc_id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice in the live index"
    return {r["doc_id"]: r for r in t.to_pylist()}


def test_build_readback_and_bad_input(tmp_path, ray_session):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, 4)
    (corpus / "empty.md").write_text("   \n")
    (corpus / "binary.txt").write_bytes(b"\x00\x01\x02 not text \xff\xfe")
    (corpus / "records.jsonl").write_text(
        json.dumps({"id": "doc00.txt", "text": "a duplicate of a file's id"}) + "\n"
        + json.dumps({"id": "long", "text": "word " * 400}) + "\n")
    cfg = load_config(write_config(tmp_path / "c.toml", shard_rows=2))
    cfg = type(cfg)(model=cfg.model, profile=cfg.profile, build=cfg.build,
                    corpus=type(cfg.corpus)(max_tokens=120))
    stats = run_build(corpus, tmp_path / "index", cfg, echo=lambda *_: None)
    assert (stats.profiled, stats.reused, stats.deleted) == (4, 0, 0)

    # Plain pyarrow, no project code: every shard the manifest lists, one row per document.
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["format"] == "sift-index" and manifest["generation"] == 1
    assert manifest["backends"] == ["torch"]
    assert {"n_layers", "n_heads", "n_kv_heads", "head_dim", "rope", "fingerprint"} <= set(manifest["model"])
    table = pq.read_table([str(tmp_path / "index" / s["path"]) for s in manifest["shards"]])
    assert sorted(table["doc_id"].to_pylist()) == ["doc00.txt", "doc01.txt", "doc02.txt", "doc03.txt"]
    n_layers, n_heads = manifest["model"]["n_layers"], manifest["model"]["n_heads"]
    for row in table.to_pylist():
        p = -(-row["n_tokens"] // 16)
        assert len(row["la_bits"]) == n_layers * n_heads * -(-(p * (p + 1) // 2) // 8)
        assert len(row["ca_bits"]) == n_layers * n_heads * -(-p // 8)

    # datasets reads the same shards.
    import datasets

    ds = datasets.Dataset.from_parquet([str(tmp_path / "index" / s["path"]) for s in manifest["shards"]])
    assert sorted(ds["doc_id"]) == sorted(table["doc_id"].to_pylist())

    # Every bad record is an errors-table row, named with its reason; nothing lost, nothing duplicated.
    errors = {r["doc_id"]: r["reason"] for r in IndexReader.open(tmp_path / "index").errors().to_pylist()}
    assert set(errors) == {"empty.md", "binary.txt", "doc00.txt", "long"}
    assert "duplicate" in errors["doc00.txt"] and "tokens" in errors["long"]


def test_too_long_split_into_parts(tmp_path, ray_session):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = " ".join(wiki_texts(3, step=5))[:900]
    (corpus / "big.txt").write_text(text)
    base = load_config(write_config(tmp_path / "c.toml"))
    cfg = type(base)(model=base.model, profile=base.profile, build=base.build,
                     corpus=type(base.corpus)(too_long="split", max_tokens=64))
    stats = run_build(corpus, tmp_path / "index", cfg, echo=lambda *_: None)
    rows = rows_by_id(tmp_path / "index")
    assert stats.errors == 0 and len(rows) >= 3
    assert set(rows) == {f"big.txt#part{i}" for i in range(len(rows))}
    assert all(r["n_tokens"] <= 64 for r in rows.values())


def test_incremental_change_add_delete(tmp_path, ray_session):
    corpus = tmp_path / "corpus"
    names = make_corpus(corpus, 5)
    cfg = load_config(write_config(tmp_path / "c.toml", shard_rows=2))
    index = tmp_path / "index"
    first = run_build(corpus, index, cfg, echo=lambda *_: None)
    assert first.profiled == 5
    before = rows_by_id(index)

    (corpus / names[1]).write_text((corpus / names[1]).read_text() + " Changed.")
    (corpus / "new.txt").write_text("A new document about the history of printing presses in Europe.")
    (corpus / names[4]).unlink()
    second = run_build(corpus, index, cfg, echo=lambda *_: None)
    assert (second.profiled, second.reused, second.deleted, second.generation) == (2, 3, 1, 2)
    after = rows_by_id(index)
    assert set(after) == set(before) - {names[4]} | {"new.txt"}
    for name in (names[0], names[2], names[3]):
        assert after[name]["la_bits"] == before[name]["la_bits"]
        assert after[name]["ca_bits"] == before[name]["ca_bits"]
        assert after[name]["content_hash"] == before[name]["content_hash"]
    assert after[names[1]]["content_hash"] != before[names[1]]["content_hash"]

    # Nothing changed: nothing re-profiled, the same shards are kept byte for byte.
    third = run_build(corpus, index, cfg, echo=lambda *_: None)
    assert (third.profiled, third.reused, third.deleted) == (0, 5, 0)
    m2 = json.loads((index / "manifests" / "gen-2.json").read_text())
    m3 = json.loads((index / "manifest.json").read_text())
    assert sorted(s["sha256"] for s in m2["shards"]) == sorted(s["sha256"] for s in m3["shards"])

    # A profile change re-profiles everything.
    cfg32 = load_config(write_config(tmp_path / "c.toml", shard_rows=2), tile=32)
    fourth = run_build(corpus, index, cfg32, echo=lambda *_: None)
    assert (fourth.profiled, fourth.reused) == (5, 0)


def run_cli(*args, check=None):
    proc = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=600)
    if check is not None:
        assert proc.returncode == check, proc.stderr[-2000:]
    return proc


def test_cli_errors_and_exit_codes(tmp_path):
    not_index = tmp_path / "stuff"
    not_index.mkdir()
    (not_index / "notes.txt").write_text("mine")
    corpus = tmp_path / "corpus"
    make_corpus(corpus, 1)
    proc = run_cli("sift-build", str(corpus), "--out", str(not_index), check=2)
    assert "not a SIFT index" in proc.stderr and "Traceback" not in proc.stderr

    bad_cfg = tmp_path / "bad.toml"
    bad_cfg.write_text("[profile]\ntile = 16\ntiles = 32\n")
    proc = run_cli("sift-build", str(corpus), "--out", str(tmp_path / "i"), "--config", str(bad_cfg), check=2)
    assert "unknown config key" in proc.stderr and "profile.tiles" in proc.stderr

    proc = run_cli("sift-build", str(tmp_path / "missing"), "--out", str(tmp_path / "i"), "--verbose", check=2)
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("sift-build", str(corpus), "--out", str(tmp_path / "i"), "--tile", "48", check=2)
    assert "tile" in proc.stderr


def test_corrupt_index_named(tmp_path, ray_session):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, 2)
    index = tmp_path / "index"
    run_build(corpus, index, load_config(write_config(tmp_path / "c.toml")), echo=lambda *_: None)
    proc = run_cli("sift-inspect", str(index), "--json", check=0)
    summary = json.loads(proc.stdout)
    assert summary["documents"] == 2 and summary["generation"] == 1 and summary["errors"] == 0
    # The per-head densities sift-inspect decodes from the bits average, over heads, to the per-layer densities
    # the profiler stored beside them.
    per_head = np.asarray(summary["la_density_per_head"]), np.asarray(summary["ca_density_per_head"])
    assert per_head[0].shape == per_head[1].shape == (summary["model"]["n_layers"], summary["model"]["n_heads"])
    for heads, layers in zip(per_head, (summary["la_density_per_layer"], summary["ca_density_per_layer"])):
        assert np.allclose(heads.mean(axis=1), layers, atol=1e-3)
    assert summary["last_build"] == {**summary["last_build"], "profiled": 2, "reused": 0, "deleted": 0}

    shard = index / json.loads((index / "manifest.json").read_text())["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli("sift-inspect", str(index), check=2)
    assert shard.name in proc.stderr and "corrupt" in proc.stderr
    with pytest.raises(SiftError, match=shard.name):
        IndexReader.open(index)

    (index / "manifest.json").write_text("{ not json")
    proc = run_cli("sift-inspect", str(index), check=2)
    assert "manifest.json is corrupt" in proc.stderr


def check_startup(last_build: dict) -> None:
    """A first build's start-up breakdown: every documented key, and the moments in the order they happen."""
    from sift.pipeline.job import STARTUP_KEYS

    s = last_build["startup"]
    assert set(s) == set(STARTUP_KEYS), set(s) ^ set(STARTUP_KEYS)
    assert 0 <= s["process"] < 60 and s["ray"] > 0 and s["plan"] > 0
    assert 0 < s["imports"] and 0 < s["weights"] and s["imports"] + s["weights"] <= s["model_load"]
    assert 0 <= s["cuda"] <= s["imports"] and s["cuda_driver"] >= 0  # CUDA's start (a GPU actor's), else 0
    assert 0 <= s["warmup"] <= s["model_load"]  # beside the weights' load (a GPU actor's), else 0
    # The actor's moments come from its own clock (the same machine here): started, set up, ready, in order, and
    # its set-up lasting what it measured itself.
    assert s["actor_code"] <= s["actor_init"] <= s["actor_ready"] <= s["first_shard"]
    assert abs((s["actor_ready"] - s["actor_init"]) - s["model_load"]) < 0.05
    assert s["first_records"] <= s["first_submit"] <= s["first_shard"] <= last_build["seconds"]
    assert 0 < s["first_shard_compute"] < s["first_shard"]
    assert s["first_records"] <= s["last_records"] <= last_build["seconds"]
    assert s["first_shard"] <= s["last_shard"] <= last_build["seconds"]


def test_cuda_driver_starts_beside_the_actors_imports(monkeypatch):
    """A GPU actor's CUDA start (`_CudaStart`) runs on a thread of its own: the set-up carries on while `cuInit`
    is still running, then the device's primary context is retained; a failed `cuInit` asks for no context, and a
    machine without the driver library ends it quietly (torch's own start reports the problem). The driver is a
    stand-in that records its calls, so this runs without a GPU."""
    import ctypes
    import threading

    from sift.pipeline.job import _CudaStart

    running, release, calls = threading.Event(), threading.Event(), []

    class Driver:
        def __init__(self, init_result: int):
            self.init_result = init_result

        def cuInit(self, flags):
            calls.append(("cuInit", flags))
            running.set()
            release.wait(30)
            return self.init_result

        def cuDeviceGet(self, device, ordinal):
            calls.append(("cuDeviceGet", ordinal))
            return 0

        def cuDevicePrimaryCtxRetain(self, context, device):
            calls.append(("cuDevicePrimaryCtxRetain", device.value))
            return 0

    libraries = []
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libraries.append(name) or Driver(0))
    start = _CudaStart()
    assert running.wait(30)
    assert start.thread.is_alive() and calls == [("cuInit", 0)]  # the caller has control while cuInit runs
    release.set()
    assert start.join() > 0
    assert libraries == ["libcuda.so.1"]
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # as torch sets it before its own cuInit
    assert calls == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain", 0)]

    calls.clear()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(100))  # CUDA_ERROR_NO_DEVICE
    _CudaStart().join()
    assert calls == [("cuInit", 0)]

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert _CudaStart().join() >= 0


_FIRST_ACTOR = """
import sys
from sift.pipeline import job
from sift.pipeline.config import load_config

class Stop(Exception):
    pass

def start(self, echo):  # the moment a first build asks for its actors
    print("ray.data imported:", "ray.data" in sys.modules, flush=True)
    raise Stop

job._Pool.start = start
try:
    job.run_build(sys.argv[1], sys.argv[2], load_config(None), echo=lambda *_: None)
except Stop:
    pass
"""


def test_actors_are_asked_for_before_ray_data_is_imported(tmp_path):
    """A first build asks for its profiling actors the moment Ray is up, before the driver imports Ray Data (the
    reading tasks' library, which the actors do not need), so that import is not on the actors' path."""
    make_corpus(tmp_path / "corpus", 1)
    proc = subprocess.run([sys.executable, "-c", _FIRST_ACTOR, str(tmp_path / "corpus"), str(tmp_path / "index")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ray.data imported: False" in proc.stdout, proc.stdout


def _session_processes(session: Path) -> list[int]:
    """Processes holding a file of the Ray session folder `session` open (its GCS, raylet, agents, workers)."""
    held = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        if any(link.startswith(f"{session}/") for link in links):
            held.append(int(pid))
    return held


def test_sigkill_mid_build_then_resume_with_concurrent_reader(tmp_path):
    corpus = tmp_path / "corpus"
    names = make_corpus(corpus, 3)
    cfg = write_config(tmp_path / "c.toml", shard_rows=1)
    index = tmp_path / "index"
    # The command exits right after its summary line, without stopping its local Ray one process after another:
    # within seconds, no process of that Ray session is left (`-q` puts the driver's native error lines into the
    # session's log folder, under the driver's pid).
    proc = subprocess.Popen([str(BIN / "sift-build"), str(corpus), "--out", str(index), "--config", str(cfg), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.startswith("committed generation 1"), err[-2000:]
    from ray._common.utils import get_default_system_temp_dir

    sessions = [d for d in (Path(get_default_system_temp_dir()) / "ray").glob("session_*")
                if not d.is_symlink() and (d / "logs" / f"sift-build-{proc.pid}.err").exists()]
    assert len(sessions) == 1, sessions
    deadline = time.monotonic() + 10
    while _session_processes(sessions[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session_processes(sessions[0])
    gen1 = rows_by_id(index)
    check_startup(IndexReader.open(index).manifest.last_build)

    more = make_corpus(tmp_path / "more", 10, chars=400)
    for name in more:
        (corpus / f"more-{name}").write_text((tmp_path / "more" / name).read_text())
    proc = subprocess.Popen([str(BIN / "sift-build"), str(corpus), "--out", str(index), "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 400
    seen_generations = set()
    try:
        while time.time() < deadline:
            # A reader during the build always sees a whole committed generation.
            reader = IndexReader.open(index)
            t = reader.table(["doc_id"])
            assert t.num_rows == reader.manifest.documents
            seen_generations.add(reader.generation)
            new_parts = [p for p in (index / "shards").glob("part-*.parquet")
                         if f"shards/{p.name}" not in {s.path for s in reader.manifest.shards}]
            if len(new_parts) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the build wrote no shard in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the build and its Ray workers, mid-run
        proc.wait()
    assert seen_generations == {1}
    assert rows_by_id(index).keys() == gen1.keys()  # the previous generation, whole

    out = run_cli("sift-build", str(corpus), "--out", str(index), "--config", str(cfg), check=0)
    assert "recovered" in out.stderr or "reused" in out.stdout
    # stderr is not a terminal: one progress line per shard (one document each here), none of Ray's INFO logs.
    progress = [line for line in out.stderr.splitlines() if re.match(r"sift-build: profiled \d+/\d+ documents", line)]
    assert not re.search(r"\sINFO\s", out.stderr), out.stderr
    final = rows_by_id(index)
    assert set(final) == set(names) | {f"more-{n}" for n in more}
    summary = json.loads(run_cli("sift-inspect", str(index), "--json", check=0).stdout)
    assert summary["generation"] == 2
    assert summary["last_build"]["reused"] >= 3 + 2  # the 3 old documents + what the killed build finished
    assert summary["last_build"]["profiled"] + summary["last_build"]["reused"] == 13
    assert len(progress) == summary["last_build"]["profiled"] > 0, out.stderr
    for name in names:
        assert final[name]["la_bits"] == gen1[name]["la_bits"]


def test_first_source_streams_a_forwards_worth_at_a_time(tmp_path):
    """The driver hands on the first source's records in batches of at least `every_tokens` tokens (the last one
    excepted) as it tokenises them; together they are exactly the records of tokenising it in one batch."""
    from sift.model import default_model_dir
    from sift.pipeline.corpus import list_sources
    from sift.pipeline.plan import read_and_tokenize, tokenize_records

    texts = wiki_texts(12, step=7)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                              for i, t in enumerate(texts)) + json.dumps({"id": "e", "text": " "}))
    source = list_sources(tmp_path / "c.jsonl")[0]
    kwargs = dict(model_dir=str(default_model_dir()), id_field="id", text_field="text", max_tokens=8192,
                  too_long="error")
    whole = read_and_tokenize({"index": [0], "source": [dict(source.__dict__)]}, **kwargs)
    every = 3 * max(whole["n_tokens"])
    batches = list(tokenize_records({"index": [0], "source": [dict(source.__dict__)]}, **kwargs,
                                    every_tokens=every))
    assert len(batches) > 2
    assert all(sum(b["n_tokens"]) >= every and sum(b["n_tokens"][:-1]) < every for b in batches[:-1])
    assert {k: [x for b in batches for x in b[k]] for k in whole} == whole
    assert whole["error"][-1] and len(whole["key"]) == 13


class ScriptedTasks:
    """Stands in for the Ray tasks' stream (`_Ahead`): `get` answers from a script of batches, None (nothing
    arrived) and `_Ahead.END`, then END for ever."""

    def __init__(self, script):
        self.script = list(script)

    def get(self, timeout):
        from sift.pipeline.plan import _Ahead

        return self.script.pop(0) if self.script else _Ahead.END


def test_driver_takes_sources_the_tasks_have_not_delivered(tmp_path):
    """Whenever the Ray tasks deliver nothing for a tick, the driver tokenises the next source in corpus order
    itself and drops the tasks' copy of it later (also out of a block that holds another source too): every
    record comes exactly once and in corpus order, whatever the timing, and the stream ends once every source
    came, without waiting for the tasks' end."""
    from sift.model import default_model_dir
    from sift.pipeline.corpus import list_sources
    from sift.pipeline.plan import _Ahead, _shared, read_and_tokenize

    texts = wiki_texts(12, step=5)
    for f in range(4):
        (tmp_path / f"p{f}.jsonl").write_text("".join(json.dumps({"id": f"d{f}-{i}", "text": t}) + "\n"
                                                      for i, t in enumerate(texts[3 * f: 3 * f + 3])))
    (tmp_path / "p4.jsonl").write_text("")            # a source without records: the tasks send an empty batch
    sources = list_sources(tmp_path)
    rows = [{"index": i, "source": dict(s.__dict__)} for i, s in enumerate(sources)]
    kwargs = dict(model_dir=str(default_model_dir()), id_field="id", text_field="text", max_tokens=8192,
                  too_long="error")
    alone = {r["index"]: read_and_tokenize({"index": [r["index"]], "source": [r["source"]]}, **kwargs)
             for r in rows}          # what the tasks deliver: each source tokenised on its own
    want = [k for i in range(5) for k in alone[i]["key"]]
    assert want == sorted(want) and len(want) == 12 and not alone[4]["key"]

    def merged(*batches):
        return {c: [v for b in batches for v in b[c]] for c in batches[0]}

    def run(script, tick=None):
        tasks = ScriptedTasks(script)
        out = list(_shared(tasks, rows, kwargs, every_tokens=40, tick=tick))
        got = [b for b in out if b is not None]
        keys = [k for b in got for k in b["key"]]
        assert keys == want, keys                       # exactly once, in corpus order
        for b in got:                                   # each row whole: its tokens are those of the source alone
            for k, ids in zip(b["key"], b["token_ids"]):
                src = alone[int(k.split(":")[0])]
                assert list(ids) == list(src["token_ids"][list(src["key"]).index(k)])
        return out, tasks.script

    # The tasks deliver everything at once: the driver tokenises nothing (the empty source's batch hands on
    # nothing; the tasks' end says that source is complete).
    out, left = run([alone[i] for i in range(5)] + [_Ahead.END])
    assert len(out) == 4 and not left
    # The tasks are silent at first: the driver takes source 0 (a piece at a time); meanwhile the tasks deliver
    # 0 (dropped), 1, then 2 and 3 in one block, then the empty 4: all handed on after the driver's 0, in order.
    out, left = run([None, alone[0], alone[1], merged(alone[2], alone[3]), alone[4], _Ahead.END], tick=0.1)
    assert None not in out
    # The tasks never deliver: the driver tokenises every source in order and ends without the tasks' end.
    out, left = run([None] * 40, tick=0.1)
    assert None not in out and left and _Ahead.END not in left
