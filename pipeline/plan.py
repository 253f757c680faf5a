"""The builder's first stage: decide, document by document, what a build does with it.

    resolve_target   the previous generation, the model's identity, the profiling prefix, the profile key
    reusable         the rows the build may reuse instead of profiling, known before any document is read
    tokenised        read + tokenise every source: Ray tasks streaming records, in corpus order, to the driver
    Planner          per record as it arrives: error row (unreadable, empty, too long, duplicate id), reused row,
                     or a document to profile (handed on at once); `finish` -> `BuildPlan`

A live document is reusable when a row with the same (doc_id, content_hash) and the same profile key exists in
the previous generation or in a whole shard a killed build left behind (an "orphan"); every other live document
is profiled. Records stream in corpus order (Ray Data keeps the order), so the duplicate policy, first
occurrence wins, is decided as they arrive. A shard of the previous generation that cannot be read (missing,
altered, not Parquet) is skipped with a warning, so the documents it held are profiled again; a store that does
not answer stops the build. Nothing here writes to the index.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sift import format as fmt
from sift.errors import SiftError
from sift.format import Manifest, ModelIdentity, ShardInfo, content_hash
from sift.model import DEFAULT_MODEL, fingerprint
from sift.storage import Location

from .config import BuildConfig
from .corpus import FirstOccurrence, Source, SourceDoc, read_source

log = logging.getLogger("sift.build")

LISTING_COLUMNS = ["key", "doc_id", "source", "n_tokens", "content_hash", "error"]

Pair = tuple[str, str]                # (doc_id, content_hash): what identifies a reusable row
ErrorRow = tuple[str, str, str]       # (doc_id, source, reason): one row of the errors table


@dataclass(frozen=True)
class BuildTarget:
    """What the new generation is built for, decided before any document is read."""

    previous: Manifest | None   # the committed generation this build replaces, None for a first build
    model: ModelIdentity
    prefix_ids: tuple[int, ...]  # the tokens placed before every document while profiling (SPEC section 1)
    reader_ids: tuple[int, ...]  # the reader placed after every document (reader criterion), else empty
    max_tokens: int              # the longest document the model can profile after the prefix
    profile_key: str             # hash of everything that decides the bits: equal keys mean reusable rows


@dataclass(frozen=True)
class BuildPlan:
    """What a build did with the corpus's records: which were profiled, which rows are reused, which records are
    error rows."""

    target: BuildTarget
    corpus: str                     # the corpus path, resolved, or its URI without credentials (in the manifest)
    todo: int                       # documents handed to profiling
    todo_tokens: int                # their tokens
    reuse: Mapping[Pair, str]       # reused row -> the shard (relative path) that holds it
    errors: tuple[ErrorRow, ...]    # records that are not indexed, in corpus order
    reused: int                     # live documents found in the previous generation
    recovered: int                  # live documents found in orphan shards
    deleted: int                    # doc_ids of the previous generation that are gone
    note: str = ""


# ------------------------------------------------------------------------------------------------------------
# The target


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _previous_generation(index: Location) -> Manifest | None:
    """The committed manifest; when manifest.json was lost, the newest history copy, so the build continues the
    history (the next generation is one more) instead of starting it again at 1."""
    gens = fmt.history(index)
    if index.exists(fmt.MANIFEST) or not gens:
        return fmt.read_manifest(index)
    newest = gens[max(gens)]
    try:
        previous = fmt.load_manifest(index, newest)
    except SiftError as e:
        good, live = index.show(f"{fmt.HISTORY}/gen-K.json"), index.show(fmt.MANIFEST)
        restore = f"cp {good} {live}" if index.local else f"copy {good} to {live}"
        raise SiftError(f"{live} is missing and its newest history copy is unusable ({e}); restore a good copy "
                        f"with `{restore}`") from None
    log.warning("%s is missing: continuing from %s", index.show(fmt.MANIFEST), index.show(newest))
    return previous


def resolve_target(cfg: BuildConfig, model_dir: Path, index: Location) -> BuildTarget:
    """Read the previous generation and the model's identity; derive the prefix, max_tokens and profile key.
    Needs no Ray: the build runs it while the actors set up. (transformers, and torch with it, are imported here,
    not with the module, so neither delays the driver's start nor a reading task that only tokenises.)"""
    from transformers import AutoConfig

    from .profiler import profiling_prefix_ids, profiling_reader_ids

    previous = _previous_generation(index)
    name = DEFAULT_MODEL if cfg.model == DEFAULT_MODEL else str(model_dir)
    model = ModelIdentity.from_config(name, fingerprint(model_dir), AutoConfig.from_pretrained(model_dir))
    tokenizer = _tokenizer(str(model_dir))
    prefix_ids = profiling_prefix_ids(tokenizer, cfg.profile)
    reader = tuple(profiling_reader_ids(tokenizer, cfg.profile))
    room = model.max_position_embeddings - len(prefix_ids) - len(reader)
    return BuildTarget(previous=previous, model=model, prefix_ids=tuple(prefix_ids), reader_ids=reader,
                       max_tokens=min(cfg.corpus.max_tokens or room, room),
                       profile_key=cfg.profile_key(model.fingerprint, fmt.FORMAT_VERSION, reader))


# ------------------------------------------------------------------------------------------------------------
# Read + tokenise (Ray tasks; pure functions of their batch)


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


def read_and_tokenize(batch: dict, **kwargs) -> dict:
    """Ray Data map_batches fn over source rows -> one row per document record (errors included), as
    `tokenize_records` yields them (keyword arguments alike), in one batch."""
    return next(tokenize_records(batch, **kwargs))


def tokenize_records(batch: dict, *, model_dir: str, id_field: str, text_field: str, max_tokens: int,
                     too_long: str, follow_symlinks: bool = False, every_tokens: int = 0):
    """The records of the sources in `batch` (source rows), tokenised, as batches of rows (at least one, maybe
    empty): every `every_tokens` tokens when given, so the first documents of a large source reach profiling
    while the rest is tokenised; else all in one.

    `key` is "<source index>:<row index>[:<part>]", zero-padded, so sorting keys restores corpus order.
    """
    tok = _tokenizer(model_dir)
    columns = LISTING_COLUMNS + ["token_ids"]
    out, tokens = {c: [] for c in columns}, 0

    def emit(key, doc_id, source, ids, error):
        nonlocal tokens
        out["key"].append(key)
        out["doc_id"].append(doc_id)
        out["source"].append(source)
        out["n_tokens"].append(len(ids))
        out["content_hash"].append(content_hash(ids) if ids else "")
        out["error"].append(error)
        out["token_ids"].append(ids)
        tokens += len(ids)

    for s_idx, s_fields in zip(batch["index"], batch["source"]):
        docs: list[SourceDoc] = read_source(Source(**s_fields), id_field=id_field, text_field=text_field,
                                            follow_symlinks=follow_symlinks)
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
            if every_tokens and tokens >= every_tokens:
                yield out
                out, tokens = {c: [] for c in columns}, 0
    if out["key"] or not every_tokens:
        yield out


def tokenised(sources: list[Source], model_dir: Path, cfg: BuildConfig, max_tokens: int, tick: float | None = None):
    """Every record of every source, tokenised, as batches in corpus order (`read_and_tokenize` rows); with
    `tick`, also None whenever no batch arrived from the Ray tasks for `tick` seconds.

    The driver reads the first source itself (its tokenizer is loaded already) and hands its records on a
    forward's worth (`build.batch_tokens`) at a time, so the first ones are profiled while it tokenises the rest;
    Ray tasks (Ray Data, one source per call) read the others, started at the same moment in the background, so
    they stream in meanwhile. Whenever no batch has come from them for a tick (their workers still import
    transformers and load the tokenizer, or a small corpus has fewer sources than the cluster has idle CPUs), the
    driver takes the next source in corpus order that has not come and tokenises it itself, a forward's worth at a
    time; the Ray tasks' copy of a source the driver took is dropped when it arrives, so every source's records
    come exactly once, in corpus order. Once every source has come, the stream ends without waiting for the tasks
    still running."""
    import ray.data

    kwargs = dict(model_dir=str(model_dir), id_field=cfg.corpus.id_field, text_field=cfg.corpus.text_field,
                  max_tokens=max_tokens, too_long=cfg.corpus.too_long, follow_symlinks=cfg.corpus.follow_symlinks)
    rows = [{"index": i, "source": dict(s.__dict__)} for i, s in enumerate(sources)]
    rest = None
    if len(rows) > 1:
        rest = _Ahead(ray.data.from_items(rows[1:], override_num_blocks=max(1, min(len(rows) - 1, 256))).map_batches(
            read_and_tokenize, batch_size=1, fn_kwargs=kwargs).iter_batches(batch_size=None, batch_format="numpy",
                                                                             prefetch_batches=4))
    done = False
    try:
        yield from tokenize_records({"index": [0], "source": [rows[0]["source"]]}, **kwargs,
                                    every_tokens=cfg.build.batch_tokens)
        if rest is not None:
            yield from _shared(rest, rows[1:], kwargs, cfg.build.batch_tokens, tick)
        done = True
    finally:  # a build that stops early (an error, an interrupt) stops the reading thread with it
        if rest is not None:
            # At the end, the tasks of sources the driver took may still run: not waited for.
            rest.close(timeout_s=0.0 if done else 2.0)


STEAL_TICK_S = 0.1   # how long the driver waits for a batch from the Ray tasks before it tokenises a source itself


def _by_source(batch: dict) -> list[tuple[int, dict]]:
    """A batch of records split by source, in order -> [(source index, its rows)] (none for an empty batch)."""
    sources = [int(str(k).split(":", 1)[0]) for k in batch["key"]]
    out = []
    for s in dict.fromkeys(sources):
        keep = [x == s for x in sources]
        out.append((s, batch if all(keep) else {c: [v for v, k in zip(batch[c], keep) if k] for c in batch}))
    return out


def _shared(rest: "_Ahead", rows: list[dict], kwargs: dict, every_tokens: int, tick: float | None):
    """The records of the sources `rows` (in corpus order) from the Ray tasks behind `rest`, which deliver them in
    corpus order, the driver tokenising the next source itself whenever nothing of it came for a tick
    (`tokenised`); with `tick`, also None per idle tick. Yields in corpus order."""
    order = [int(r["index"]) for r in rows]
    source_of = {int(r["index"]): r["source"] for r in rows}
    held: dict[int, list] = {}      # the tasks' rows of sources not handed on yet
    taken: set[int] = set()         # sources the driver tokenised or tokenises: the tasks' copies are dropped
    seen, ended = -1, False         # the highest source the tasks delivered rows of; whether they all finished
    own = None                      # the driver's source in progress (a generator)
    pos = 0
    while pos < len(order):
        f = order[pos]
        busy = own is not None or f in held
        item = rest.get(0.0 if busy else (tick or STEAL_TICK_S))
        if item is _Ahead.END:
            ended = True
        elif item is not None:
            for s, part in _by_source(item):
                seen = max(seen, s)
                if s not in taken:
                    held.setdefault(s, []).append(part)
        if own is not None:
            piece = next(own, None)
            if piece is None:
                own, pos = None, pos + 1
            else:
                yield piece
            continue
        yield from held.pop(f, [])
        # the tasks keep corpus order: rows of a later source, or their end, mean f is complete
        if f < seen or ended:
            pos += 1
        elif item is None and f != seen:
            taken.add(f)            # nothing of f has come: the driver reads it itself
            own = tokenize_records({"index": [f], "source": [source_of[f]]}, **kwargs, every_tokens=every_tokens)
        elif item is None and tick is not None:
            yield None


class _Ahead:
    """Iterates `batches` on a thread of its own from the moment it is made (up to `depth` batches ahead), so the
    work behind them starts before the first one is asked for; an error is raised where the batch would be.
    `close` stops the thread: one left blocked inside Ray's client when the process exits can crash it."""

    END = object()

    def __init__(self, batches, depth: int = 8):
        import queue
        import threading

        self.queue = queue.Queue(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._pull, args=(batches,), daemon=True, name="sift-records")
        self.thread.start()

    def _pull(self, batches) -> None:
        try:
            for batch in batches:
                if not self._put(batch):
                    return
            self._put(self.END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room unless closed meanwhile -> whether it was queued."""
        import queue

        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop reading ahead: the thread returns at once if it waits for room in the queue, else once the batch
        it waits for arrives (or Ray, shut down, fails it); the caller waits at most `timeout_s` for that."""
        self.stopped.set()
        self.thread.join(timeout_s)

    def get(self, timeout: float | None):
        """The next batch, `_Ahead.END` after the last, or None if none arrived within `timeout` seconds (0: only
        what is queued already; None: wait for it); an error is raised where its batch would be."""
        import queue

        try:
            item = self.queue.get_nowait() if timeout == 0 else self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self):
        while (item := self.get(None)) is not self.END:
            yield item


# ------------------------------------------------------------------------------------------------------------
# Reuse


def _pairs(index: Location, rel: str) -> list[Pair]:
    t = pq.read_table(index.path(rel), filesystem=index.fs, columns=["doc_id", "content_hash"])
    return list(zip(t["doc_id"].to_pylist(), t["content_hash"].to_pylist()))


@dataclass(frozen=True)
class _Previous:
    """The previous generation's shards, each read once."""

    rows: dict[Pair, str]     # reusable row -> the shard that holds it (none when the profile key changed)
    ids: frozenset[str]       # doc_ids of the readable shards
    unreadable: tuple[tuple[ShardInfo, str], ...] = ()  # shards that cannot be read, with why


def _shard_pairs(index: Location, shard: ShardInfo) -> tuple[list[Pair] | None, str]:
    """The rows of one listed shard, or None and why it is unreadable: missing, bytes that are not the ones the
    manifest lists, or not Parquet. A store that fails to answer is not an unreadable shard: SiftError."""
    try:
        if index.sha256(shard.path) != shard.sha256:
            return None, "its bytes do not match the manifest's sha256"
        return _pairs(index, shard.path), ""
    except FileNotFoundError:
        return None, "it is missing"
    except OSError as e:
        if not index.local:
            raise SiftError(f"cannot read {index.show(shard.path)}: {index.explain(e, 'read')}") from None
        return None, e.strerror or str(e).splitlines()[0]
    except (pa.ArrowException, ValueError) as e:
        return None, f"not Parquet: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def _read_previous(index: Location, previous: Manifest | None, profile_key: str) -> _Previous:
    """Every shard of the previous generation: its rows when readable. The documents of an unreadable shard are
    found in no readable one, so the plan profiles them again from the corpus: nothing is lost, and since a
    generation lists each doc_id once, nothing is duplicated."""
    if previous is None:
        return _Previous({}, frozenset())
    rows, ids, unreadable = {}, set(), []
    for shard in previous.shards:
        pairs, why = _shard_pairs(index, shard)
        if pairs is None:
            log.warning("shard %s of generation %d is unreadable (%s): its %d documents are profiled again from "
                        "the corpus", index.show(shard.path), previous.generation, why, shard.rows)
            unreadable.append((shard, why))
            continue
        ids.update(doc_id for doc_id, _ in pairs)
        if previous.profile_key == profile_key:
            rows.update((pair, shard.path) for pair in pairs)
    return _Previous(rows, frozenset(ids), tuple(unreadable))


def _unreadable_note(previous: Manifest, unreadable: tuple[tuple[ShardInfo, str], ...]) -> str:
    """What the summary and the manifest's last_build say about skipped shards ("" when there were none)."""
    if not unreadable:
        return ""
    shards = ", ".join(f"{s.path} ({s.rows} documents: {why})" for s, why in unreadable)
    return (f"unreadable shard(s) of generation {previous.generation} skipped: {shards}; the corpus documents "
            f"they held were profiled again, and those no longer in the corpus are not counted as deleted")


def _whole(index: Location, rel: str) -> bool:
    """Whether an orphan shard is whole. A local one is (it got its name by an atomic rename); on a store whose
    partly written objects can be visible (HDFS) the bytes must hash to the name."""
    return index.local or index.sha256(rel).startswith(rel.rsplit("-", 1)[-1].removesuffix(".parquet"))


def _orphan_rows(index: Location, previous: Manifest | None, profile_key: str) -> dict[Pair, str]:
    """Rows in whole shards a killed build wrote (not in the manifest) with the same profile key."""
    live = {s.path for s in previous.shards} if previous else set()
    rows = {}
    for rel in index.files(fmt.SHARDS):
        name = rel.rsplit("/", 1)[-1]
        if rel in live or not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        try:
            meta = pq.read_schema(index.path(rel), filesystem=index.fs).metadata or {}
            if meta.get(fmt.PROFILE_KEY_META, b"").decode() != profile_key or not _whole(index, rel):
                continue
            pairs = _pairs(index, rel)
        except Exception as e:  # a torn file cannot have its final name, but be safe
            log.warning("ignoring unreadable shard %s: %s", index.show(rel), e)
            continue
        for pair in pairs:
            rows.setdefault(pair, rel)
    return rows


# ------------------------------------------------------------------------------------------------------------
# The stage


@dataclass(frozen=True)
class Reusable:
    """The rows a build may reuse instead of profiling: (doc_id, content_hash) -> the shard holding the row."""

    previous: Mapping[Pair, str]  # rows of the previous generation (same profile key)
    orphans: Mapping[Pair, str]   # rows of whole shards a killed build left behind (same profile key)
    previous_ids: frozenset[str] = frozenset()   # doc_ids of the previous generation's readable shards
    unreadable: tuple = ()                       # (ShardInfo, why) of its shards that could not be read


def reusable(index: Location, target: BuildTarget) -> Reusable:
    """Each shard of the previous generation is read once (`_read_previous`)."""
    previous = _read_previous(index, target.previous, target.profile_key)
    return Reusable(previous.rows, _orphan_rows(index, target.previous, target.profile_key), previous.ids,
                    previous.unreadable)


@dataclass(frozen=True)
class Todo:
    """A document to profile, as the stream delivered it."""

    doc_id: str
    source: str
    content_hash: str
    token_ids: np.ndarray  # int32


@dataclass
class Planner:
    """Classifies the tokenised records as they stream in (`admit`, in corpus order) and hands on the documents to
    profile; `finish` gives what the build did with every record."""

    target: BuildTarget
    reusable: Reusable
    corpus: str
    duplicates: FirstOccurrence = field(default_factory=FirstOccurrence)
    errors: list[ErrorRow] = field(default_factory=list)
    reuse: dict[Pair, str] = field(default_factory=dict)
    live_ids: set[str] = field(default_factory=set)
    reused: int = 0
    recovered: int = 0
    todo: int = 0
    todo_tokens: int = 0
    last_key: str = ""

    def admit(self, batch: dict) -> list[Todo]:
        """One batch of `read_and_tokenize` rows -> the documents among them to profile."""
        out = []
        for key, doc_id, source, error, digest, ids in zip(batch["key"], batch["doc_id"], batch["source"],
                                                            batch["error"], batch["content_hash"],
                                                            batch["token_ids"]):
            if key <= self.last_key:  # the duplicate policy needs corpus order
                raise RuntimeError(f"records arrived out of corpus order ({key} after {self.last_key}): Ray Data's "
                                   f"preserve_order is off")
            self.last_key = key
            # A block whose records all read cleanly carries the error column as nulls (NaN in numpy).
            error = str(error) if isinstance(error, str) and error else None
            doc_id, source, digest = str(doc_id), str(source), str(digest)
            doc = self.duplicates(SourceDoc(doc_id, None, source, error))
            if doc.error is not None:
                self.errors.append((doc.doc_id, doc.source, doc.error))
                continue
            self.live_ids.add(doc_id)
            pair = (doc_id, digest)
            if pair in self.reusable.previous:
                self.reuse[pair] = self.reusable.previous[pair]
                self.reused += 1
            elif pair in self.reusable.orphans:
                self.reuse[pair] = self.reusable.orphans[pair]
                self.recovered += 1
            else:
                out.append(Todo(doc_id, source, digest, np.asarray(ids, dtype=np.int32)))
                self.todo += 1
                self.todo_tokens += len(ids)
        return out

    def summary(self) -> str:
        return (f"sift-build: {len(self.live_ids)} documents ({self.reused} unchanged, {self.recovered} recovered "
                f"from an interrupted build, {self.todo} to profile), {len(self.errors)} error rows")

    def finish(self, index: Location) -> BuildPlan:
        target = self.target
        changed = target.previous is not None and target.previous.profile_key != target.profile_key
        notes = ["profile or model changed: every document is re-profiled" if changed else "",
                 _unreadable_note(target.previous, self.reusable.unreadable)]
        return BuildPlan(target=target, corpus=self.corpus, todo=self.todo, todo_tokens=self.todo_tokens,
                         reuse=self.reuse, errors=tuple(self.errors), reused=self.reused, recovered=self.recovered,
                         deleted=len(self.reusable.previous_ids - self.live_ids),
                         note="; ".join(n for n in notes if n))
