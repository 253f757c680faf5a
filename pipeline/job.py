"""The builder's Ray job: plan -> profile -> commit, under the index's writer lock.

    plan     (`plan.py`) read + tokenise (Ray tasks), duplicates, error rows, what to reuse -> `BuildPlan`
    profile  the documents to profile, on a pool of `ProfileShardWriter` actors (GPU, or CPU), one immutable
             Parquet shard per batch -> `Profiled`
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sift import format as fmt
from sift.errors import SiftError, one_line, root_cause
from sift.format import Manifest, ShardInfo
from sift.model import resolve_model_dir
from sift.storage import Location, is_uri, redact

from . import index as idx
from . import ray_driver
from .config import BuildConfig
from .corpus import list_sources
from .plan import BuildPlan, ErrorRow, Pair, plan, resolve_target


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
    profile_seconds: float = 0.0   # wall time of the profiling stage (actor start-up included)
    actor_seconds: float = 0.0     # summed time the actors spent profiling documents
    backends: list[str] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------------------------
# Profile (Ray actors: heavy setup once, then a pure call per batch)


class ProfileShardWriter:
    """Profiles a batch of documents and writes them as one immutable shard; returns the shard's description
    and one error row per document that failed (a failure never stops the batch)."""

    def __init__(self, *, model: str, cfg_dict: dict, index: str, profile_key: str, threads: int):
        import torch

        from sift.model import load_model

        from ..kernels.device import resolve_backend
        from .config import BACKENDS, load_config_dict
        from .profiler import Profiler

        cfg = load_config_dict(cfg_dict)
        torch.set_num_threads(max(1, threads))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = resolve_backend(cfg.build.backend, device, choices=BACKENDS, setting="build.backend")
        model_obj, tokenizer, _ = load_model(model, dtype=cfg.profile.dtype, device=device)
        self.profiler = Profiler(model_obj, tokenizer, cfg.profile, backend)
        self.backend = backend
        self.index = Location.of(index)  # `index` is the location's spec: a local path or a URI
        self.profile_key = profile_key

    def __call__(self, batch: dict) -> dict:
        rows = {name: [] for name in fmt.DOCS_SCHEMA.names}
        err_ids, err_sources, err_reasons = [], [], []
        t0 = time.perf_counter()
        for doc_id, source, ids, digest in zip(batch["doc_id"], batch["source"], batch["token_ids"],
                                               batch["content_hash"]):
            ids = [int(t) for t in ids]
            try:
                bits = self.profiler.profile(ids)
            except Exception as e:  # one bad document never stops the job: it becomes an errors-table row
                err_ids.append(doc_id)
                err_sources.append(source)
                err_reasons.append(f"profiling failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
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
            info = idx.write_table(self.index, table, kind="part", profile_key=self.profile_key,
                                   backend=self.profiler.backend_label)
        return {
            "shard": [info.to_dict() if info else None],
            "doc_ids": [rows["doc_id"]],
            "tokens": [sum(rows["n_tokens"])],
            "seconds": [time.perf_counter() - t0],
            "err_ids": [err_ids], "err_sources": [err_sources], "err_reasons": [err_reasons],
        }


class _KeyFilter:
    """Picklable batch function: the rows whose listing key is to be profiled, with the columns profiling needs."""

    COLUMNS = ("doc_id", "source", "token_ids", "content_hash")

    def __init__(self, keys: frozenset[str]):
        self.keys = keys

    def __call__(self, batch: dict) -> dict:
        keep = [i for i, key in enumerate(batch["key"]) if key in self.keys]
        return {c: batch[c][keep] for c in self.COLUMNS}


@dataclass(frozen=True)
class _ActorPool:
    size: int
    resources: dict     # Ray resources of one actor
    threads: int        # torch threads per actor
    kind: str           # "gpu" or "cpu"


def _actor_pool(ray, cfg: BuildConfig) -> _ActorPool:
    """Size the profiling actor pool from the resources Ray reports (never 2 CPU actors on a 2-core box)."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
    if gpus and cfg.build.backend != "torch":
        n = cfg.build.actors or gpus
        return _ActorPool(size=n, resources={"num_gpus": 1}, threads=max(1, cpus // n - 1), kind="gpu")
    per_actor = min(8, max(1, cpus - 1))  # leave a core for Ray itself and the reading tasks
    n = cfg.build.actors or max(1, (cpus - 1) // per_actor)
    # A lone actor may use every core: the reading stage has finished by the time profiling starts.
    threads = cpus if n == 1 else per_actor
    return _ActorPool(size=n, resources={"num_cpus": per_actor}, threads=threads, kind="cpu")


@dataclass(frozen=True)
class Profiled:
    """What the profile stage produced."""

    shards: tuple[ShardInfo, ...] = ()
    errors: tuple[ErrorRow, ...] = ()   # documents whose profiling failed
    tokens: int = 0                     # tokens of the documents profiled
    seconds: float = 0.0                # wall time of the stage (actor start-up included)
    actor_seconds: float = 0.0          # summed time the actors spent profiling documents


class ProgressLines:
    """Profiling progress as one line per shard written, through `echo`: what a log file shows (the CLI draws one
    bar instead when stderr is a terminal). `start` once, `shard` per shard, `close` at the end."""

    def __init__(self, echo):
        self.echo = echo

    def start(self, documents: int, tokens: int) -> None:
        self.total, self.done, self.t0 = (documents, tokens), [0, 0], time.perf_counter()

    def shard(self, documents: int, tokens: int) -> None:
        self.done = [self.done[0] + documents, self.done[1] + tokens]
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        (docs, toks), (n_docs, n_toks) = self.done, self.total
        eta = _clock((n_toks - toks) * seconds / toks) if toks else "-"
        self.echo(f"sift-build: profiled {docs}/{n_docs} documents, {toks}/{n_toks} tokens "
                  f"({docs / seconds:.2f} docs/s, {toks / seconds:.0f} tokens/s, ETA {eta})")

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def profile(build: BuildPlan, index: Location, cfg: BuildConfig, echo, progress) -> Profiled:
    """Profile the plan's `todo` documents, `cfg.build.shard_rows` per shard, on a pool of actors."""
    if not build.todo:
        return Profiled()
    import ray
    import ray.data

    pool = _actor_pool(ray, cfg)
    echo(f"sift-build: profiling on {pool.size} {pool.kind.upper()} actor(s)")
    todo = build.docs.map_batches(_KeyFilter(build.todo), batch_format="numpy")
    # Everything handed to the actors is absolute: they run in their own working directory, on other machines.
    assert not index.local or index.local_path.is_absolute(), index.uri
    results = todo.map_batches(
        ProfileShardWriter, batch_size=cfg.build.shard_rows, batch_format="numpy",
        fn_constructor_kwargs=dict(model=build.target.model.name, cfg_dict=cfg.to_dict(), index=index.spec,
                                   profile_key=build.target.profile_key, threads=pool.threads),
        compute=ray.data.ActorPoolStrategy(size=pool.size), **pool.resources)
    progress.start(len(build.todo), build.todo_tokens)
    try:
        return _collect(results, progress)
    except Exception as e:  # an actor's error arrives wrapped in Ray's; the user gets the one line behind it
        if isinstance(root_cause(e), SiftError):
            raise SiftError(one_line(e)) from e
        raise SiftError(f"profiling stopped: {one_line(e)} (nothing was committed; the next sift-build reuses "
                        f"the shards already written)") from e
    finally:
        progress.close()


def _collect(results, progress) -> Profiled:
    """Run the lazy `results` dataset to the end, reporting progress per shard."""
    t0 = time.perf_counter()
    shards, errors, tokens, actor_seconds = [], [], 0, 0.0
    for row in results.iter_rows():
        if row["shard"] is not None:
            shards.append(ShardInfo(**row["shard"]))
            tokens += int(row["tokens"])
        actor_seconds += float(row["seconds"])
        errors += zip(row["err_ids"], row["err_sources"], row["err_reasons"])
        progress.shard(len(row["doc_ids"]) + len(row["err_ids"]), int(row["tokens"]))
    return Profiled(shards=tuple(shards), errors=tuple(errors), tokens=tokens,
                    seconds=time.perf_counter() - t0, actor_seconds=actor_seconds)


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
    return Manifest(
        generation=stats.generation,
        created_at=idx.now_iso(),
        model=target.model,
        profile={**config["profile"], "prefix_token_ids": list(target.prefix_ids), "profile_key": target.profile_key},
        corpus={"path": build.corpus, **config["corpus"], "max_tokens": target.max_tokens},
        backends=stats.backends,
        shards=shards,
        errors=errors,
        documents=stats.documents,
        tokens=_count_tokens(index, shards),
        last_build=stats.to_dict(),
    )


def commit(build: BuildPlan, profiled: Profiled, index: Location, cfg: BuildConfig, t_start: float,
           lock) -> BuildStats:
    """Assemble and commit the new generation, then delete the files neither it nor the previous one lists.
    lock: what `idx.build_lock` yielded, checked just before the commit (a lease on an object store can be lost)."""
    previous = build.target.previous
    shards = _assemble(index, build.reuse, build.target.profile_key) + list(profiled.shards)
    errors = _write_errors(index, build.errors + profiled.errors)
    stats = BuildStats(
        generation=idx.next_generation(index, previous), documents=sum(s.rows for s in shards),
        profiled=sum(s.rows for s in profiled.shards), reused=build.reused, reused_orphans=build.recovered,
        deleted=build.deleted, errors=errors.rows if errors else 0, tokens_profiled=profiled.tokens,
        profile_seconds=profiled.seconds, actor_seconds=profiled.actor_seconds,
        backends=sorted({s.backend for s in shards if s.backend}), note=build.note,
        seconds=time.perf_counter() - t_start)
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
    nothing of it outlives the driver); keep corpus order; let a profiling actor's own error reach the driver.

    Unless `verbose`, Ray prints only its errors: its INFO logs, its progress blocks and the workers' output go
    to Ray's log files alone, and the build reports its own progress (`ProgressLines`, or the CLI's bar).
    quiet: Ray's native error lines go to its log folder only (`ray_driver.native_stderr_to_logs`)."""
    import ray
    import ray.data

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        chatter = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
        if address:
            ray.init(address=address, **chatter)
        else:
            ray_driver.start_local(**chatter)
        if quiet:
            ray_driver.native_stderr_to_logs()
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


def run_build(corpus: str | Path, out: str | Path, cfg: BuildConfig, *, ray_address: str | None = None,
              echo=print, progress=None, verbose: bool = False, quiet: bool = False) -> BuildStats:
    """Build or incrementally update the index at `out` from `corpus`. Returns what the build did.

    corpus, out: local paths, or URIs `sift.storage` opens (s3://, gs://, hdfs://, file://).

    echo: where the stage lines go; progress: what reports profiling (default `ProgressLines(echo)`);
    verbose: Ray's own logs, progress blocks and worker output too; quiet: Ray's native error lines only in its
    log folder (`sift-build -q`)."""
    t_start = time.perf_counter()
    # A local --out is made absolute: actors write shards there from their own working directory.
    index = Location.of(out)
    sources = list_sources(corpus)
    model_dir = resolve_model_dir(cfg.model)
    idx.prepare_dir(index)
    with idx.build_lock(index) as lock:
        target = resolve_target(cfg, model_dir, index)
        _start_ray(ray_address, verbose, quiet)
        shown = redact(corpus) if is_uri(corpus) else corpus
        echo(f"sift-build: {len(sources)} source(s) in {shown}, model {target.model.name}, tile {cfg.profile.tile}")
        build = plan(corpus, sources, model_dir, index, cfg, target, echo)
        profiled = profile(build, index, cfg, echo, progress or ProgressLines(echo))
        return commit(build, profiled, index, cfg, t_start, lock)
