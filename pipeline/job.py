"""The builder's Ray job: read, tokenise and profile as one stream, then commit, under the index's writer lock.

    plan     (`plan.py`) the target and the reusable rows, after Ray's start; then read + tokenise as
             Ray tasks streaming records in corpus order to the driver, which decides per record: error row,
             reused row, or to profile
    profile  the documents to profile, gathered into shards (`build.shard_tokens` / `shard_rows`; a forward's
             worth when an actor is free, whatever is gathered when a set-up actor has nothing queued) as they
             arrive and handed to a pool of `ProfileShardWriter` actors (one per GPU, or CPU actors; the model
             loaded once per actor, from the moment Ray is up); each actor packs a shard into forwards of
             `build.batch_tokens` and writes it as one immutable Parquet shard off its GPU's critical path
             -> `Profiled`
    commit   the reused rows assembled into shards, the errors table, the `Manifest`, its atomic commit, and
             the deletion of files no generation lists -> `BuildStats`

The index may be a local folder or a prefix on an object store (`sift.storage.Location`); `pipeline/index.py`
writes and commits either way.

Incremental by construction: every live document is either reused (same doc_id and content_hash, same profile
key, from the previous generation or from a shard a killed build left behind) or profiled; the new manifest
lists exactly one row per live doc_id, and every corpus record that is not indexed is in the errors table.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sift import format as fmt
from sift.errors import SiftError, one_line, root_cause
from sift.format import Manifest, ShardInfo
from sift.model import DEFAULT_MODEL, prefetch_weights, resolve_model_dir
from sift.reader import reader_digest
from sift.storage import Location, is_uri, redact

from . import index as idx
from . import ray_driver
from .config import BuildConfig
from .corpus import corpus_name, list_sources
from .plan import BuildPlan, ErrorRow, Pair, Planner, Todo, resolve_target, reusable, tokenised


# `BuildStats.startup`, in seconds: durations, and moments counted from the build's start (`run_build` called);
# an actor's moments are those of the slowest actor, as far as its node's clock agrees with the driver's.
STARTUP_KEYS = {
    "process": "the sift-build process's start to the build's start (Python, imports, config; CLI only)",
    "ray": "duration: starting (or joining) Ray",
    "plan": "duration: Ray Data's set-up, previous generation, model identity, tokenizer, reusable rows (after "
            "Ray's start and the actors' creation)",
    "actor_code": "moment: the actor's process began importing the builder",
    "actor_init": "moment: the actor's set-up began (its code imported)",
    "model_load": "duration: the actor's set-up (weights on its device, profiler ready)",
    "imports": "duration: of which the imports (torch, transformers' model classes, the profiler; CUDA's start)",
    "cuda_driver": "duration: beside `imports`, the CUDA driver's start and the device's context (GPU actors; else 0)",
    "cuda": "duration: of `imports`, torch's CUDA start once the imports and `cuda_driver` are done (else 0)",
    "weights": "duration: of which `load_model` (the weights onto the device, the tokenizer)",
    "warmup": "duration: beside `weights`, the profiling path run once on dummy inputs (GPU actors; 0 on CPU)",
    "actor_ready": "moment: the actor can profile",
    "first_records": "moment: the first tokenised records reached the driver",
    "first_submit": "moment: the first shard was handed to an actor",
    "first_shard": "moment: the first shard was profiled and written",
    "first_shard_compute": "duration: that shard's profiling, warm-up included",
    "last_records": "moment: the whole corpus was read and tokenised",
    "last_shard": "moment: the last shard was profiled and written (the commit follows)",
}


@dataclass(frozen=True)
class BuildStats:
    """What a build did (returned by `run_build`, recorded as the manifest's `last_build`)."""

    generation: int = 0
    documents: int = 0
    profiled: int = 0
    reused: int = 0
    reused_orphans: int = 0
    deleted: int = 0
    errors: int = 0
    tokens_profiled: int = 0
    seconds: float = 0.0
    profile_seconds: float = 0.0   # wall time of the read + profile stream (actor start-up included)
    actor_seconds: float = 0.0     # summed time the actors spent profiling documents
    backends: list[str] = field(default_factory=list)
    note: str = ""
    # The fixed cost before the first profiled shard, seconds (`STARTUP_KEYS`).
    startup: dict = field(default_factory=dict)
    # Ray node id -> {"shards": [paths], "documents", "tokens", "seconds", "peak_memory_gib" (GPU actors)}: where
    # each shard was profiled.
    nodes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------------------------
# Profile (Ray actors: heavy setup once, then a pure call per shard)


class ProfileShardWriter:
    """Profiles a shard of documents and writes it as one immutable Parquet shard; returns the shard's
    description and one error row per document that failed (a failure never stops the shard).

    Runs two calls at once (a threaded actor): one profiles on the device while the other writes the shard it
    profiled, so writing never holds the device; the device itself runs one call at a time."""

    def __init__(self, *, model: str, cfg_dict: dict, index: str, threads: int):
        t0, init = time.perf_counter(), time.time()
        import ray

        # On a GPU, CUDA's driver starts beside the imports below rather than after them (`_CudaStart`).
        cuda_start = _CudaStart() if ray.get_gpu_ids() else None
        import torch
        import transformers

        from sift.model import load_model

        from ..kernels.device import resolve_backend
        from . import IMPORT_STARTED
        from .config import BACKENDS, load_config_dict
        from .profiler import Profiler

        transformers.AutoModelForCausalLM  # noqa: B018 - its lazy import, here rather than inside `weights`
        cfg = load_config_dict(cfg_dict)
        torch.set_num_threads(max(1, threads))
        cuda_driver = cuda_start.join() if cuda_start is not None else 0.0
        t_cuda = time.perf_counter()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.init()
        cuda = time.perf_counter() - t_cuda if device == "cuda" else 0.0
        imports = time.perf_counter() - t0
        backend = resolve_backend(cfg.build.backend, device, choices=BACKENDS, setting="build.backend")
        # The device's kernels warm up on dummy inputs while the weights load (on a GPU: Triton's kernels,
        # cuBLAS, the SDPA backends); the first shard then pays for none of it.
        warm = _WarmUp(model, cfg, backend, device) if device == "cuda" else None
        t_weights = time.perf_counter()
        model_obj, tokenizer, _ = load_model(model, dtype=cfg.profile.dtype, device=device, identity=False)
        weights = time.perf_counter() - t_weights
        warmup = warm.join() if warm is not None else 0.0
        self.profiler = Profiler(model_obj, tokenizer, cfg.profile, backend, batch_tokens=cfg.build.batch_tokens)
        self.index = Location.of(index)  # `index` is the location's spec: a local path or a URI
        self.node = ray.get_runtime_context().get_node_id()
        self.device_lock = threading.Lock()
        # The actor's start-up: wall-clock moments (the driver counts them from the build's start) and durations.
        self.timeline = {"actor_code": IMPORT_STARTED, "actor_init": init, "actor_ready": time.time(),
                         "model_load": time.perf_counter() - t0, "imports": imports, "weights": weights,
                         "warmup": warmup, "cuda": cuda, "cuda_driver": cuda_driver}

    def ready(self) -> None:
        """Answers once the actor is set up (the driver's sign that it can profile)."""

    def profile_shard(self, shard: dict, profile_key: str) -> dict:
        """shard: {"doc_id", "source", "content_hash": lists, "token_ids": list of int arrays}; profile_key: the
        build's, written into the shard -> the shard's `ShardInfo` dict (None when every document failed), its
        documents and tokens, error rows, timings and where it ran."""
        with self.device_lock:
            t0 = time.perf_counter()
            results = self.profiler.profile_batch(shard["token_ids"])
            seconds = time.perf_counter() - t0
            backend = self.profiler.backend_label
        rows = {name: [] for name in fmt.DOCS_SCHEMA.names}
        errors = []
        for doc_id, source, digest, ids, bits in zip(shard["doc_id"], shard["source"], shard["content_hash"],
                                                     shard["token_ids"], results):
            if isinstance(bits, Exception):  # one bad document never stops the job: it becomes an error row
                errors.append((doc_id, source, f"profiling failed: {type(bits).__name__}: "
                                               f"{(str(bits).splitlines() or [''])[0][:200]}"))
                continue
            rows["doc_id"].append(doc_id)
            rows["content_hash"].append(digest)
            rows["n_tokens"].append(len(ids))
            rows["la_bits"].append(bits.la)
            rows["ca_bits"].append(bits.ca)
            rows["source"].append(source)
            rows["la_density"].append(bits.la_density)
            rows["ca_density"].append(bits.ca_density)
        info = None
        if rows["doc_id"]:
            table = pa.Table.from_pydict(rows, schema=fmt.DOCS_SCHEMA)
            info = idx.write_table(self.index, table, kind="part", profile_key=profile_key, backend=backend)
        return {"shard": info.to_dict() if info else None, "documents": len(rows["doc_id"]),
                "tokens": sum(rows["n_tokens"]), "seconds": seconds, "errors": errors, "node": self.node,
                "timeline": self.timeline, "peak_memory_gib": self._peak_gib()}

    @staticmethod
    def _peak_gib() -> float | None:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


class _Beside:
    """`self.work(*args)` on a daemon thread of its own, from the moment the object is made (beside what the
    actor's set-up does meanwhile); `join` -> its seconds."""

    def __init__(self, name: str, *args):
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._timed, args=args, daemon=True, name=name)
        self.thread.start()

    def _timed(self, *args) -> None:
        t0 = time.perf_counter()
        try:
            self.work(*args)
        finally:
            self.seconds = time.perf_counter() - t0

    def work(self, *args) -> None:
        raise NotImplementedError

    def join(self) -> float:
        self.thread.join()
        return self.seconds


class _CudaStart(_Beside):
    """The CUDA driver's start (`cuInit`) and the device's primary context (the one torch's runtime uses) on a
    thread of its own, from the first moment of a GPU actor's set-up: ctypes lets go of the interpreter lock for
    the length of each driver call, so the driver's start (seconds on a large GPU, most of it in `cuInit`) runs
    while the actor imports torch and transformers instead of after them, and torch's own CUDA start then finds
    both done. It starts after Ray chose the actor's GPU (CUDA_VISIBLE_DEVICES, set before the set-up begins),
    which the driver reads in `cuInit`. It decides nothing: without a driver or a device it ends, and torch's
    start, which follows it, meets and reports the same problem. The context is retained for the life of the
    process, as torch's is. `join` -> its seconds."""

    def __init__(self, library: str = "libcuda.so.1"):
        # What torch sets before its own `cuInit` (the driver reads it there): kernels load on first use.
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
        super().__init__("sift-cuda-start", library)

    def work(self, library: str) -> None:
        import ctypes

        try:
            driver = ctypes.CDLL(library)
            device, context = ctypes.c_int(0), ctypes.c_void_p()
            if driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), 0) == 0:
                driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
        except (OSError, AttributeError):  # no driver library, or not this one: torch's start reports it
            pass


class _WarmUp(_Beside):
    """`profiler.warm_up` on a thread of its own, from the moment it is made; `join` -> its seconds. A warm-up
    that fails is logged and otherwise ignored: it changes no result, and a real shard meets the same error."""

    def __init__(self, model: str, cfg, backend: str, device: str):
        super().__init__("sift-warm-up", model, cfg, backend, device)

    def work(self, model: str, cfg, backend: str, device: str) -> None:
        try:
            import torch
            from transformers import AutoConfig, AutoTokenizer

            from .profiler import warm_up

            model_dir = resolve_model_dir(model)
            warm_up(AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir), cfg.profile,
                    backend, device=device, dtype=getattr(torch, cfg.profile.dtype))
        except Exception as e:  # noqa: BLE001 - see the class docstring
            logging.getLogger("sift.build").warning("the profiling warm-up failed (the first shard warms up "
                                                    "instead): %s", one_line(e))


@dataclass(frozen=True)
class _ActorPool:
    size: int
    resources: dict     # Ray resources of one actor
    threads: int        # torch threads per actor
    kind: str           # "gpu" or "cpu"


def _actor_pool(ray, cfg: BuildConfig) -> _ActorPool:
    """Size the profiling actor pool from the resources Ray reports: one actor per GPU, else CPU actors that
    each leave a core of their node to Ray and the reading tasks (never 2 CPU actors on a 2-core box)."""
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    if gpus and cfg.build.backend != "torch":
        n = cfg.build.actors or gpus
        return _ActorPool(size=n, resources={"num_gpus": 1}, threads=max(1, int(res.get("CPU", 1)) // n - 1),
                          kind="gpu")
    node_cpus = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")]
    node_cpus = [c for c in node_cpus if c > 0] or [1]
    # A CPU actor reserves all but one core of its node, so the reading tasks always have one (on a 1-core node
    # it reserves none: it would otherwise wait for records that cannot be read).
    per_actor = min(8, min(node_cpus) - 1)
    n = cfg.build.actors or sum(max(1, (c - 1) // max(per_actor, 1)) for c in node_cpus)
    # An actor alone on its node may use the node's cores: reading is a small share of a build's CPU time.
    threads = cfg.build.threads or (max(node_cpus) if n <= len(node_cpus) else max(per_actor, 1))
    return _ActorPool(size=n, resources={"num_cpus": per_actor}, threads=threads, kind="cpu")


@dataclass(frozen=True)
class Profiled:
    """What the profile stage produced."""

    shards: tuple[ShardInfo, ...] = ()
    errors: tuple[ErrorRow, ...] = ()   # documents whose profiling failed
    tokens: int = 0                     # tokens of the documents profiled
    seconds: float = 0.0                # wall time of the stage (actor start-up included)
    actor_seconds: float = 0.0          # summed time the actors spent profiling documents
    startup: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)


class ProgressLines:
    """Profiling progress as one line per shard written, through `echo`: what a log file shows (the CLI draws one
    bar instead when stderr is a terminal). `start` once, `total` as the stream finds documents to profile,
    `shard` per shard, `close` at the end. While the corpus is still being read the totals are those found so
    far and the ETA is "-"."""

    def __init__(self, echo):
        self.echo = echo

    def start(self, documents: int, tokens: int) -> None:
        self.total_, self.done, self.final, self.t0 = (documents, tokens), [0, 0], True, time.perf_counter()

    def total(self, documents: int, tokens: int, final: bool) -> None:
        self.total_, self.final = (documents, tokens), final

    def shard(self, documents: int, tokens: int) -> None:
        self.done = [self.done[0] + documents, self.done[1] + tokens]
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        (docs, toks), (n_docs, n_toks) = self.done, self.total_
        eta = _clock((n_toks - toks) * seconds / toks) if toks and self.final else "-"
        self.echo(f"sift-build: profiled {docs}/{n_docs} documents, {toks}/{n_toks} tokens "
                  f"({docs / seconds:.2f} docs/s, {toks / seconds:.0f} tokens/s, ETA {eta})")

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class _Shards:
    """Gathers the documents to profile into shards of at most `rows` documents and `tokens` tokens (a longer
    document is a shard of its own)."""

    def __init__(self, rows: int, tokens: int):
        self.max_rows, self.max_tokens = rows, tokens
        self.docs: list[Todo] = []
        self.tokens = 0

    def add(self, doc: Todo) -> dict | None:
        """Add a document; returns the shard it closed, if any."""
        closed = None
        if self.docs and (len(self.docs) >= self.max_rows or self.tokens + len(doc.token_ids) > self.max_tokens):
            closed = self.take()
        self.docs.append(doc)
        self.tokens += len(doc.token_ids)
        return closed

    def take(self) -> dict | None:
        if not self.docs:
            return None
        docs, self.docs, self.tokens = self.docs, [], 0
        return {"doc_id": [d.doc_id for d in docs], "source": [d.source for d in docs],
                "content_hash": [d.content_hash for d in docs], "token_ids": [d.token_ids for d in docs]}


class _Pool:
    """The profiling actors: made by `start` (as soon as the build knows it will profile, so the model loads while
    the rest is planned and the corpus read), with at most DEPTH shards queued on each (one profiling, one
    waiting or being written), so the device never waits for the driver."""

    DEPTH = 2

    def __init__(self, ray, cfg: BuildConfig, index: Location, model: str):
        # Everything handed to the actors is absolute: they run in their own working directory, on other machines.
        assert not index.local or index.local_path.is_absolute(), index.uri
        self.spec = _actor_pool(ray, cfg)
        self.actor_class = ray.remote(ProfileShardWriter).options(
            max_concurrency=self.DEPTH, max_restarts=2, max_task_retries=2, scheduling_strategy="SPREAD",
            **self.spec.resources)
        self.kwargs = dict(model=model, cfg_dict=cfg.to_dict(), index=index.spec, threads=self.spec.threads)
        self.actors: list = []
        self.load: list[int] = []
        self.in_flight: dict = {}
        self.starting: dict = {}   # `ready` call -> actor, until it answers
        self.checked = 0.0

    def start(self, echo) -> None:
        if not self.actors:
            echo(f"sift-build: profiling on {self.spec.size} {self.spec.kind.upper()} actor(s)")
            self.actors = [self.actor_class.remote(**self.kwargs) for _ in range(self.spec.size)]
            self.load = [0] * self.spec.size
            self.starting = {actor.ready.remote(): i for i, actor in enumerate(self.actors)}

    def idle(self, done) -> bool:
        """Whether an actor has nothing queued (finished shards collected first, at most every 50 ms)."""
        if self.actors and time.perf_counter() - self.checked > 0.05:
            self.collect(done, block=False)
            self.checked = time.perf_counter()
        return bool(self.actors) and min(self.load) == 0

    def waiting(self, done) -> bool:
        """Whether a set-up actor has nothing queued: it would take a shard of any size now."""
        import ray

        if not self.idle(done):
            return False
        if self.starting:
            ready, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
            for ref in ready:
                ray.get(ref)  # an actor that failed to start raises here, as its shards would
                del self.starting[ref]
        return any(load == 0 for i, load in enumerate(self.load) if i not in self.starting.values())

    def submit(self, shard: dict, profile_key: str, done) -> None:
        while min(self.load) >= self.DEPTH:
            self.collect(done, block=True)
        i = self.load.index(min(self.load))
        self.in_flight[self.actors[i].profile_shard.remote(shard, profile_key)] = i
        self.load[i] += 1

    def collect(self, done, block: bool) -> None:
        """Hand finished shards to `done`; with block, wait for at least one."""
        import ray

        while self.in_flight:
            ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=None if block else 0)
            if not ready:
                return
            self.load[self.in_flight.pop(ready[0])] -= 1
            done(ray.get(ready[0]))
            block = False

    def drain(self, done) -> None:
        while self.in_flight:
            self.collect(done, block=True)


class _Results:
    """What the actors report, gathered shard by shard as they finish."""

    def __init__(self, progress, t_start: float, wall_start: float):
        self.progress, self.t_start, self.wall_start = progress, t_start, wall_start
        self.shards: list[ShardInfo] = []
        self.errors: list[ErrorRow] = []
        self.nodes: dict = {}
        self.startup: dict = {}
        self.ready = float("-inf")
        self.tokens, self.actor_seconds = 0, 0.0

    def __call__(self, result: dict) -> None:
        now = time.perf_counter() - self.t_start
        if "first_shard" not in self.startup:
            self.startup.update(first_shard=now, first_shard_compute=result["seconds"])
        self.startup["last_shard"] = now
        timeline = result["timeline"]
        if timeline["actor_ready"] > self.ready:  # the slowest actor's start-up
            self.ready = timeline["actor_ready"]
            self.startup.update({k: v - self.wall_start if k.startswith("actor_") else v
                                 for k, v in timeline.items()})
        node = self.nodes.setdefault(result["node"], {"shards": [], "documents": 0, "tokens": 0, "seconds": 0.0})
        if result["shard"] is not None:
            info = ShardInfo(**result["shard"])
            self.shards.append(info)
            node["shards"].append(info.path)
        node["documents"] += result["documents"]
        node["tokens"] += result["tokens"]
        node["seconds"] += result["seconds"]
        if result["peak_memory_gib"] is not None:
            node["peak_memory_gib"] = max(node.get("peak_memory_gib", 0.0), result["peak_memory_gib"])
        self.tokens += result["tokens"]
        self.actor_seconds += result["seconds"]
        self.errors.extend(tuple(e) for e in result["errors"])
        self.progress.shard(result["documents"] + len(result["errors"]), result["tokens"])


def profile(records, planner: Planner, pool: _Pool, cfg: BuildConfig, echo, progress, t_start: float,
            wall_start: float) -> Profiled:
    """Stream `records` (the tokenised corpus) through `planner` and profile what it hands on, shard by shard, on
    the pool's actors (started here at the first document to profile, unless already started). t_start,
    wall_start: the build's start on `time.perf_counter` and on `time.time` (the actors' clock)."""
    profile_key = planner.target.profile_key
    results = _Results(progress, t_start, wall_start)
    batching = _Shards(cfg.build.shard_rows, cfg.build.shard_tokens)
    t0 = time.perf_counter()
    progress.start(0, 0)

    def submit(shard: dict | None) -> None:
        if shard is not None:
            results.startup.setdefault("first_submit", time.perf_counter() - t_start)
            pool.submit(shard, profile_key, results)

    try:
        for batch in records:
            if batch is not None:
                results.startup.setdefault("first_records", time.perf_counter() - t_start)
                for doc in planner.admit(batch):
                    pool.start(echo)  # the model loads while the corpus is still being read
                    shard = batching.add(doc)
                    if shard is None and batching.tokens >= cfg.build.batch_tokens and pool.idle(results):
                        shard = batching.take()  # an actor is free: a forward's worth now, not a full shard later
                    submit(shard)
                progress.total(planner.todo, planner.todo_tokens, final=False)
            if batching.docs and pool.waiting(results):  # a set-up actor has nothing to do: what is gathered
                submit(batching.take())
            pool.collect(results, block=False)
        results.startup["last_records"] = time.perf_counter() - t_start
        submit(batching.take())
        progress.total(planner.todo, planner.todo_tokens, final=True)
        echo(planner.summary())
        pool.drain(results)
    except Exception as e:  # an actor's or a task's error arrives wrapped in Ray's; the user gets the line behind it
        # Ray's wrapper of an actor's SiftError is itself an instance of SiftError (its message is the remote
        # traceback): the original travels in `.cause`.
        wrapped = getattr(e, "cause", None)
        err = wrapped if isinstance(wrapped, BaseException) else e
        if isinstance(err, SiftError):
            raise SiftError(str(err).splitlines()[0] if str(err) else "SiftError") from e
        if isinstance(root_cause(err), SiftError):
            raise SiftError(one_line(err)) from e
        raise SiftError(f"profiling stopped: {one_line(e)} (nothing was committed; the next sift-build reuses "
                        f"the shards already written)") from e
    finally:
        progress.close()
    return Profiled(shards=tuple(results.shards), errors=tuple(results.errors), tokens=results.tokens,
                    seconds=time.perf_counter() - t0, actor_seconds=results.actor_seconds, startup=results.startup,
                    nodes=results.nodes)


# ------------------------------------------------------------------------------------------------------------
# Commit


def _assemble(index: Location, wanted: dict[Pair, str], profile_key: str) -> list[ShardInfo]:
    """Shards holding exactly the wanted reused rows: a shard whose rows are all wanted is kept byte for byte;
    otherwise its wanted rows are copied (bits unchanged) into a new shard."""
    by_shard: dict[str, set] = {}
    for key, path in wanted.items():
        by_shard.setdefault(path, set()).add(key)
    out = []
    for path, keys in sorted(by_shard.items()):
        t = pq.read_table(index.path(path), filesystem=index.fs)
        pairs = list(zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()))
        mask = [p in keys for p in pairs]
        if all(mask) and len(set(pairs)) == len(pairs):
            out.append(idx.shard_info(index, path))
            continue
        # keep the first copy of each wanted row only
        taken, keep = set(), []
        for p, m in zip(pairs, mask):
            keep.append(m and p not in taken)
            if m:
                taken.add(p)
        backend = (t.schema.metadata or {}).get(fmt.BACKEND_META, b"").decode()
        sub = t.filter(pa.array(keep)).replace_schema_metadata(None)
        out.append(idx.write_table(index, sub, kind="part", profile_key=profile_key, backend=backend))
    return out


def _write_errors(index: Location, rows: tuple[ErrorRow, ...]) -> ShardInfo | None:
    """The errors table of the generation, None when every record was indexed."""
    if not rows:
        return None
    table = pa.Table.from_pylist([dict(zip(fmt.ERRORS_SCHEMA.names, r)) for r in rows], schema=fmt.ERRORS_SCHEMA)
    return idx.write_table(index, table, kind="errors")


def _count_tokens(index: Location, shards: list[ShardInfo]) -> int:
    return sum(int(pc.sum(pq.read_table(index.path(s.path), filesystem=index.fs,
                                        columns=["n_tokens"])["n_tokens"]).as_py() or 0)
               for s in shards)


def _manifest(build: BuildPlan, cfg: BuildConfig, stats: BuildStats, shards: list[ShardInfo],
              errors: ShardInfo | None, index: Location) -> Manifest:
    target, config = build.target, cfg.to_dict()
    profile = {**config["profile"], "prefix_token_ids": list(target.prefix_ids), "profile_key": target.profile_key}
    if cfg.profile.criterion == "reader":
        profile.update(reader_tokens=len(target.reader_ids), reader_sha256=reader_digest(list(target.reader_ids)))
    else:  # the reader criterion's keys: absent from a threshold index, as before they existed
        for key in ("coverage", "reader"):
            del profile[key]
    return Manifest(
        generation=stats.generation,
        created_at=idx.now_iso(),
        model=target.model,
        profile=profile,
        corpus={"path": build.corpus, **config["corpus"], "max_tokens": target.max_tokens},
        backends=stats.backends,
        shards=shards,
        errors=errors,
        documents=stats.documents,
        tokens=_count_tokens(index, shards),
        last_build=stats.to_dict(),
    )


def commit(build: BuildPlan, profiled: Profiled, index: Location, cfg: BuildConfig, t_start: float,
           lock, startup: dict) -> BuildStats:
    """Assemble and commit the new generation, then delete the files neither it nor the previous one lists.
    lock: what `idx.build_lock` yielded, checked just before the commit (a lease on an object store can be lost);
    startup: the fixed costs measured before profiling (`BuildStats.startup`)."""
    startup = {**startup, **profiled.startup}
    previous = build.target.previous
    shards = _assemble(index, build.reuse, build.target.profile_key) + list(profiled.shards)
    errors = _write_errors(index, build.errors + profiled.errors)
    stats = BuildStats(
        generation=idx.next_generation(index, previous), documents=sum(s.rows for s in shards),
        profiled=sum(s.rows for s in profiled.shards), reused=build.reused, reused_orphans=build.recovered,
        deleted=build.deleted, errors=errors.rows if errors else 0, tokens_profiled=profiled.tokens,
        profile_seconds=profiled.seconds, actor_seconds=profiled.actor_seconds,
        backends=sorted({s.backend for s in shards if s.backend}), note=build.note,
        seconds=time.perf_counter() - t_start, startup=startup, nodes=profiled.nodes)
    manifest = _manifest(build, cfg, stats, shards, errors, index)
    lock.check()
    idx.commit_manifest(index, manifest)
    keep = {f.path for f in manifest.files()}
    if previous:  # readers that opened the previous generation may still be reading its files
        keep |= {f.path for f in previous.files()}
    idx.collect_garbage(index, keep)
    return stats


# ------------------------------------------------------------------------------------------------------------
# The driver


def _start_ray(address: str | None, verbose: bool, quiet: bool = False) -> None:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS), else start a local one (`ray_driver.start_local`:
    nothing of it outlives the driver).

    Unless `verbose`, Ray prints only its errors: its INFO logs and the workers' output go to Ray's log files
    alone, and the build reports its own progress (`ProgressLines`, or the CLI's bar).
    quiet: Ray's native error lines go to its log folder only (`ray_driver.native_stderr_to_logs`)."""
    import ray

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        chatter = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
        if address:
            ray.init(address=address, **chatter)
        else:
            ray_driver.start_local(**chatter)
        if quiet:
            ray_driver.native_stderr_to_logs()


def _stream_settings(verbose: bool) -> None:
    """Ray Data, for the reading tasks (imported once the actors are asked for: they need none of it): keep
    corpus order; let a task's own error reach the driver; unless `verbose`, no progress blocks nor console logs."""
    import ray.data

    if not verbose:
        # Ray Data logs to its file and to a handler named "console" (its default logging config): quiet the
        # console, so the file keeps everything and a failure reaches the user as the build's one line.
        for handler in logging.getLogger("ray.data").handlers:
            if handler.name == "console":
                handler.setLevel(logging.CRITICAL)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = verbose
    # A failing batch raises its own error (an OSError naming the path, a SiftError), not Ray Data's
    # "UDF failed to process a data block", whose cause does not survive the trip to the driver.
    ctx.raise_original_map_exception = True


def _plan(cfg: BuildConfig, model_dir: Path, index: Location, verbose: bool) -> tuple:
    """Ray Data's settings (`_stream_settings`), then the build's plan, which needs no Ray: (the target, the
    reusable rows, the seconds of both)."""
    t0 = time.perf_counter()
    _stream_settings(verbose)
    target = resolve_target(cfg, model_dir, index)
    return target, reusable(index, target), time.perf_counter() - t0


def run_build(corpus: str | Path, out: str | Path, cfg: BuildConfig, *, ray_address: str | None = None,
              echo=print, progress=None, verbose: bool = False, quiet: bool = False,
              process_started: float | None = None) -> BuildStats:
    """Build or incrementally update the index at `out` from `corpus`. Returns what the build did.

    corpus, out: local paths, or URIs `sift.storage` opens (s3://, gs://, hdfs://, file://).

    echo: where the stage lines go; progress: what reports profiling (default `ProgressLines(echo)`);
    verbose: Ray's own logs, progress blocks and worker output too; quiet: Ray's native error lines only in its
    log folder (`sift-build -q`); process_started: when the calling process started (`time.time`), for
    `startup["process"]`.

    Start-up runs side by side: on a first build the profiling actors (their imports and model load, in their own
    processes) from the moment Ray is up, while the driver plans and reads the first records; on a local Ray the
    weight files start coming into the page cache before Ray starts."""
    t_start, wall_start = time.perf_counter(), time.time()
    startup = {"process": wall_start - process_started} if process_started is not None else {}
    # A local --out is made absolute: actors write shards there from their own working directory.
    index = Location.of(out)
    sources = list_sources(corpus)
    model_dir = resolve_model_dir(cfg.model)
    idx.prepare_dir(index)
    with idx.build_lock(index) as lock:
        first = not (index.exists(fmt.MANIFEST) or fmt.history(index))  # a first build profiles
        local = not (ray_address or os.environ.get("RAY_ADDRESS"))  # a local Ray: the actors run here
        if first and local:  # the actor will read the weights on this machine: into the page cache meanwhile
            prefetch_weights(model_dir)
        t0 = time.perf_counter()
        # The plan runs after Ray's start, not beside it in a thread: both are Python in this process and share
        # its interpreter lock; side by side each took longer than both one after the other (an 8B build: Ray
        # 11.4 s and the plan 18.3 s, against 7.6 s + 7.5 s). Beside the actors' set-up (other processes) it
        # costs nothing.
        _start_ray(ray_address, verbose, quiet)
        startup["ray"] = time.perf_counter() - t0
        import ray

        pool = _Pool(ray, cfg, index, DEFAULT_MODEL if cfg.model == DEFAULT_MODEL else str(model_dir))
        if first:  # load the model now
            pool.start(echo)
        target, reuse, startup["plan"] = _plan(cfg, model_dir, index, verbose)
        shown = redact(corpus) if is_uri(corpus) else corpus
        echo(f"sift-build: {len(sources)} source(s) in {shown}, model {target.model.name}, tile {cfg.profile.tile}")
        if not (reuse.previous or reuse.orphans):  # nothing to reuse: everything is profiled
            pool.start(echo)
        planner = Planner(target, reuse, corpus_name(corpus))
        records = tokenised(sources, model_dir, cfg, target.max_tokens, tick=0.1)
        try:
            profiled = profile(records, planner, pool, cfg, echo, progress or ProgressLines(echo), t_start,
                               wall_start)
        finally:
            records.close()
        return commit(planner.finish(index), profiled, index, cfg, t_start, lock, startup)
