"""The builder's Ray job: read -> tokenise (CPU tasks) -> profile (GPU actors, or CPU actors) -> Parquet
shards -> atomic manifest commit.

Incremental by construction: every live document is either reused (same doc_id and content_hash, same profile
key, from the previous generation or from a shard a killed build left behind) or profiled; the new manifest
lists exactly one row per live doc_id, and every corpus record that is not indexed is in the errors table.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sift import format as fmt
from sift.errors import SiftError
from sift.format import Manifest, content_hash
from sift.model import DEFAULT_MODEL, ModelIdentity, fingerprint, resolve_model_dir

from . import index as idx
from .config import BuildConfig
from .corpus import SourceDoc, list_sources, read_source, resolve_duplicates
from .profiler import profiling_prefix_ids

log = logging.getLogger("sift.build")

LISTING_COLUMNS = ["key", "doc_id", "source", "n_tokens", "content_hash", "error"]


@dataclass
class BuildStats:
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
# Stage 1: read + tokenise (Ray tasks; pure functions of their batch)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _split_text(tokenizer, text: str, max_tokens: int) -> list[str]:
    """Cut `text` at token boundaries into pieces that each tokenise (on their own) to <= max_tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    pieces, start_tok = [], 0
    while start_tok < len(offsets):
        take = max_tokens
        while True:
            end_tok = min(start_tok + take, len(offsets))
            c0 = offsets[start_tok][0]
            c1 = offsets[end_tok][0] if end_tok < len(offsets) else len(text)
            piece = text[c0:c1]
            if len(tokenizer(piece, add_special_tokens=False).input_ids) <= max_tokens or take <= 1:
                break
            take = max(1, int(take * 0.95))
        pieces.append(piece)
        start_tok = end_tok
    return pieces


def read_and_tokenize(batch: dict, *, model_dir: str, id_field: str, text_field: str, max_tokens: int,
                      too_long: str) -> dict:
    """Ray Data map_batches fn over source rows -> one row per document record (errors included).

    `key` is "<source index>:<row index>[:<part>]", zero-padded, so sorting keys restores corpus order.
    """
    from .corpus import Source

    tok = _tokenizer(model_dir)
    out = {c: [] for c in LISTING_COLUMNS + ["token_ids"]}

    def emit(key, doc_id, source, ids, error):
        out["key"].append(key)
        out["doc_id"].append(doc_id)
        out["source"].append(source)
        out["n_tokens"].append(len(ids))
        out["content_hash"].append(content_hash(ids) if ids else "")
        out["error"].append(error)
        out["token_ids"].append(ids)

    for s_idx, s_fields in zip(batch["index"], batch["source"]):
        docs: list[SourceDoc] = read_source(Source(**s_fields), id_field=id_field, text_field=text_field)
        for r_idx, doc in enumerate(docs):
            key = f"{int(s_idx):09d}:{r_idx:09d}"
            if doc.error is not None:
                emit(key, doc.doc_id, doc.source, [], doc.error)
                continue
            ids = tok(doc.text, add_special_tokens=False).input_ids
            if not ids:
                emit(key, doc.doc_id, doc.source, [], "document tokenises to no tokens: remove it or give it text")
            elif len(ids) <= max_tokens:
                emit(key, doc.doc_id, doc.source, ids, None)
            elif too_long == "split":
                for part, piece in enumerate(_split_text(tok, doc.text, max_tokens)):
                    emit(f"{key}:{part:06d}", f"{doc.doc_id}#part{part}", doc.source,
                         tok(piece, add_special_tokens=False).input_ids, None)
            else:
                emit(key, doc.doc_id, doc.source, [],
                     f"document has {len(ids)} tokens, more than the model's {max_tokens}: set "
                     f"corpus.too_long = \"split\" to index it in parts, or shorten it")
    return out


# ------------------------------------------------------------------------------------------------------------
# Stage 2: profile + write shards (Ray actors: heavy setup once, then a pure call per batch)


class ProfileShardWriter:
    """Profiles a batch of documents and writes them as one immutable shard; returns the shard's description
    and one error row per document that failed (a failure never stops the batch)."""

    def __init__(self, *, model: str, cfg_dict: dict, index_dir: str, profile_key: str, threads: int):
        import torch

        from .config import load_config_dict
        from sift.model import load_model

        from .profiler import Profiler

        cfg = load_config_dict(cfg_dict)
        torch.set_num_threads(max(1, threads))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = cfg.build.backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        if backend == "triton" and device != "cuda":
            raise SiftError("build.backend = 'triton' needs a GPU actor: use 'auto' or 'torch' on CPU")
        model_obj, tokenizer, _ = load_model(model, dtype=cfg.profile.dtype, device=device)
        self.profiler = Profiler(model_obj, tokenizer, cfg.profile, backend)
        self.backend = backend
        self.index_dir = Path(index_dir)
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
            info = idx.write_table(self.index_dir, table, kind="part", profile_key=self.profile_key,
                                   backend=self.profiler.backend_label)
        return {
            "shard": [info.to_dict() if info else None],
            "doc_ids": [rows["doc_id"]],
            "tokens": [sum(rows["n_tokens"])],
            "seconds": [time.perf_counter() - t0],
            "err_ids": [err_ids], "err_sources": [err_sources], "err_reasons": [err_reasons],
        }


# ------------------------------------------------------------------------------------------------------------
# The driver


def _init_ray(address: str | None):
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
    return ray


def _actor_plan(ray, cfg: BuildConfig) -> dict:
    """Size the profiling actor pool from the resources Ray reports (never 2 CPU actors on a 2-core box)."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
    if gpus and cfg.build.backend != "torch":
        n = cfg.build.actors or gpus
        return {"size": n, "resources": {"num_gpus": 1}, "threads": max(1, cpus // n - 1), "kind": "gpu"}
    per_actor = min(8, max(1, cpus - 1))  # leave a core for Ray itself and the reading tasks
    n = cfg.build.actors or max(1, (cpus - 1) // per_actor)
    # A lone actor may use every core: the reading stage has finished by the time profiling starts.
    threads = cpus if n == 1 else per_actor
    return {"size": n, "resources": {"num_cpus": per_actor}, "threads": threads, "kind": "cpu"}


def _previous_rows(index_dir: Path, manifest: dict | None, profile_key: str) -> dict[tuple[str, str], str]:
    """(doc_id, content_hash) -> shard path for every reusable row of the previous generation."""
    if manifest is None or manifest.profile_key != profile_key:
        return {}
    rows = {}
    for s in manifest.shards:
        path = index_dir / s.path
        try:
            if fmt.sha256_file(path) != s.sha256:
                raise OSError("sha256 mismatch")
            t = pq.read_table(path, columns=["doc_id", "content_hash"])
        except OSError as e:
            log.warning("previous shard %s is unreadable (%s): its documents are re-profiled", path, e)
            continue
        for d, h in zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()):
            rows[(d, h)] = s.path
    return rows


def _orphan_rows(index_dir: Path, manifest: dict | None, profile_key: str) -> dict[tuple[str, str], str]:
    """Rows in whole shards a killed build wrote (not in the manifest) with the same profile key."""
    live = {s.path for s in manifest.shards} if manifest else set()
    rows = {}
    for f in sorted((index_dir / fmt.SHARDS).glob("part-*.parquet")):
        rel = f"{fmt.SHARDS}/{f.name}"
        if rel in live:
            continue
        try:
            meta = pq.read_schema(f).metadata or {}
            if meta.get(fmt.PROFILE_KEY_META, b"").decode() != profile_key:
                continue
            t = pq.read_table(f, columns=["doc_id", "content_hash"])
        except Exception as e:  # a torn file cannot have its final name, but be safe
            log.warning("ignoring unreadable shard %s: %s", f, e)
            continue
        for d, h in zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()):
            rows.setdefault((d, h), rel)
    return rows


def _assemble(index_dir: Path, wanted: dict[tuple[str, str], str], profile_key: str) -> list[fmt.ShardInfo]:
    """Shards holding exactly the wanted reused rows: a shard whose rows are all wanted is kept byte for byte;
    otherwise its wanted rows are copied (bits unchanged) into a new shard."""
    by_shard: dict[str, set] = {}
    for key, path in wanted.items():
        by_shard.setdefault(path, set()).add(key)
    out = []
    for path, keys in sorted(by_shard.items()):
        t = pq.read_table(index_dir / path)
        pairs = list(zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()))
        mask = [p in keys for p in pairs]
        seen_all = all(mask) and len(set(pairs)) == len(pairs)
        if seen_all:
            out.append(idx.shard_info(index_dir, path))
            continue
        # keep the first copy of each wanted row only
        taken, keep = set(), []
        for p, m in zip(pairs, mask):
            keep.append(m and p not in taken)
            if m:
                taken.add(p)
        meta = t.schema.metadata or {}
        backend = meta.get(fmt.BACKEND_META, b"").decode()
        sub = t.filter(pa.array(keep)).replace_schema_metadata(None)
        out.append(idx.write_table(index_dir, sub, kind="part", profile_key=profile_key, backend=backend))
    return out


def run_build(corpus: str | Path, out: str | Path, cfg: BuildConfig, *, ray_address: str | None = None,
              echo=print) -> BuildStats:
    """Build or incrementally update the index at `out` from `corpus`. Returns what the build did."""
    t_start = time.perf_counter()
    index_dir = Path(out)
    sources = list_sources(corpus)
    model_dir = resolve_model_dir(cfg.model)
    idx.prepare_dir(index_dir)
    with idx.build_lock(index_dir):
        prev = fmt.read_manifest(index_dir)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_dir)
        name = DEFAULT_MODEL if cfg.model == DEFAULT_MODEL else str(model_dir)
        identity = ModelIdentity.from_config(name, fingerprint(model_dir), hf_config)
        tokenizer = _tokenizer(str(model_dir))
        prefix_ids = profiling_prefix_ids(tokenizer, cfg.profile)
        max_tokens = cfg.corpus.max_tokens or (identity.max_position_embeddings - len(prefix_ids))
        max_tokens = min(max_tokens, identity.max_position_embeddings - len(prefix_ids))
        profile_key = cfg.profile_key(identity.fingerprint, fmt.FORMAT_VERSION)

        ray = _init_ray(ray_address)
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = True
        echo(f"sift-build: {len(sources)} source(s) in {corpus}, model {identity.name}, tile {cfg.profile.tile}")

        src_rows = [{"index": i, "source": dict(s.__dict__)} for i, s in enumerate(sources)]
        docs = ray.data.from_items(src_rows, override_num_blocks=max(1, min(len(src_rows), 64))).map_batches(
            read_and_tokenize, batch_size=1, fn_kwargs=dict(
                model_dir=str(model_dir), id_field=cfg.corpus.id_field, text_field=cfg.corpus.text_field,
                max_tokens=max_tokens, too_long=cfg.corpus.too_long)).materialize()
        listing = pa.concat_tables(
            [pa.Table.from_pandas(b, preserve_index=False) if not isinstance(b, pa.Table) else b
             for b in docs.select_columns(LISTING_COLUMNS).iter_batches(batch_format="pyarrow")]
        ).sort_by("key")

        # Duplicate policy (first occurrence in corpus order wins), then error rows vs live documents.
        resolved = resolve_duplicates(
            SourceDoc(d, None, s, e) for d, s, e in zip(listing["doc_id"].to_pylist(),
                                                        listing["source"].to_pylist(),
                                                        listing["error"].to_pylist()))
        errors = {"doc_id": [], "source": [], "reason": []}
        live: dict[str, tuple[str, str, int]] = {}  # key -> (doc_id, content_hash, n_tokens)
        for key, doc, h, n in zip(listing["key"].to_pylist(), resolved, listing["content_hash"].to_pylist(),
                                  listing["n_tokens"].to_pylist()):
            if doc.error is not None:
                errors["doc_id"].append(doc.doc_id)
                errors["source"].append(doc.source)
                errors["reason"].append(doc.error)
            else:
                live[key] = (doc.doc_id, h, n)

        prev_rows = _previous_rows(index_dir, prev, profile_key)
        orphan_rows = _orphan_rows(index_dir, prev, profile_key)
        reuse: dict[tuple[str, str], str] = {}
        todo_keys = set()
        stats = BuildStats()
        for key, (doc_id, h, _) in live.items():
            pair = (doc_id, h)
            if pair in prev_rows:
                reuse[pair] = prev_rows[pair]
                stats.reused += 1
            elif pair in orphan_rows:
                reuse[pair] = orphan_rows[pair]
                stats.reused_orphans += 1
            else:
                todo_keys.add(key)
        live_ids = {doc_id for doc_id, _, _ in live.values()}
        if prev is not None:
            prev_ids = {d for d, _ in _all_prev_pairs(index_dir, prev)}
            stats.deleted = len(prev_ids - live_ids)
        if prev is not None and prev.profile_key != profile_key:
            stats.note = "profile or model changed: every document is re-profiled"
        echo(f"sift-build: {len(live)} documents ({stats.reused} unchanged, {stats.reused_orphans} recovered "
             f"from an interrupted build, {len(todo_keys)} to profile), {len(errors['doc_id'])} error rows")

        new_shards: list[fmt.ShardInfo] = []
        backends = set()
        if todo_keys:
            plan = _actor_plan(ray, cfg)
            echo(f"sift-build: profiling on {plan['size']} {plan['kind'].upper()} actor(s)")
            todo = docs.map_batches(_KeyFilter(todo_keys), batch_format="numpy")
            results = todo.map_batches(
                ProfileShardWriter, batch_size=cfg.build.shard_rows, batch_format="numpy",
                fn_constructor_kwargs=dict(model=cfg.model, cfg_dict=cfg.to_dict(), index_dir=str(index_dir),
                                           profile_key=profile_key, threads=plan["threads"]),
                compute=ray.data.ActorPoolStrategy(size=plan["size"]), **plan["resources"])
            t_prof = time.perf_counter()
            done = 0
            for row in results.iter_rows():
                if row["shard"] is not None:
                    info = fmt.ShardInfo(**row["shard"])
                    new_shards.append(info)
                    backends.add(info.backend)
                    stats.tokens_profiled += int(row["tokens"])
                    stats.profiled += info.rows
                stats.actor_seconds += float(row["seconds"])
                errors["doc_id"] += list(row["err_ids"])
                errors["source"] += list(row["err_sources"])
                errors["reason"] += list(row["err_reasons"])
                done += len(row["doc_ids"]) + len(row["err_ids"])
                rate = done / max(time.perf_counter() - t_prof, 1e-9)
                echo(f"sift-build: profiled {done}/{len(todo_keys)} documents ({rate:.2f} docs/s)")
            stats.profile_seconds = time.perf_counter() - t_prof

        kept = _assemble(index_dir, reuse, profile_key)
        for s in kept:
            backends.add(s.backend)
        shards = kept + new_shards
        err_table = pa.Table.from_pydict(errors, schema=fmt.ERRORS_SCHEMA)
        err_info = idx.write_table(index_dir, err_table, kind="errors") if err_table.num_rows else None

        stats.generation = (prev.generation if prev else 0) + 1
        stats.documents = sum(s.rows for s in shards)
        stats.errors = err_table.num_rows
        stats.backends = sorted(b for b in backends if b)
        stats.seconds = time.perf_counter() - t_start
        manifest = Manifest(
            generation=stats.generation,
            created_at=idx.now_iso(),
            model=identity,
            profile={**cfg.to_dict()["profile"], "prefix_token_ids": prefix_ids, "profile_key": profile_key},
            corpus={"path": str(Path(corpus).resolve()), **cfg.to_dict()["corpus"], "max_tokens": max_tokens},
            backends=stats.backends,
            shards=shards,
            errors=err_info,
            documents=stats.documents,
            tokens=_count_tokens(index_dir, shards),
            last_build=stats.to_dict(),
        )
        idx.commit_manifest(index_dir, manifest)
        keep = {s.path for s in shards} | ({err_info.path} if err_info else set())
        if prev:  # readers that opened the previous generation may still be reading its files
            keep |= {s.path for s in prev.files()}
        idx.collect_garbage(index_dir, keep)
        return stats


class _KeyFilter:
    """Picklable batch function: the rows whose listing key is to be profiled, with the columns profiling needs."""

    COLUMNS = ("doc_id", "source", "token_ids", "content_hash")

    def __init__(self, keys: set[str]):
        self.keys = keys

    def __call__(self, batch: dict) -> dict:
        keep = [i for i, key in enumerate(batch["key"]) if key in self.keys]
        return {c: batch[c][keep] for c in self.COLUMNS}


def _all_prev_pairs(index_dir: Path, manifest: dict) -> set[tuple[str, str]]:
    pairs = set()
    for s in manifest.shards:
        try:
            t = pq.read_table(index_dir / s.path, columns=["doc_id", "content_hash"])
        except OSError:
            continue
        pairs |= set(zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()))
    return pairs


def _count_tokens(index_dir: Path, shards: list[fmt.ShardInfo]) -> int:
    return sum(int(pc.sum(pq.read_table(index_dir / s.path, columns=["n_tokens"])["n_tokens"]).as_py() or 0)
               for s in shards)
