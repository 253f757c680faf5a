"""The index as serving code sees it: every document's bits in host memory, a budgeted LRU of device copies,
and `fetch`, which turns a batch's documents into the `DocBits` the block-index decoder reads.

    SiftIndex.open(path)      manifest + shards (checksums verified), from a folder or a URI (s3://, gs://, hdfs://,
                              file://; `sift.storage`) -> one flat uint8 host buffer per kind
                              (la, ca), pinned when CUDA is available, plus int64 offsets/lengths per row
    index.fetch(docs)         [(doc_id, n_tokens)] in layout order -> DocBits on the index's device

Why a device cache: the same documents recur across requests (RAG corpora are Zipfian), and their bits are
read by every layer's decode. A hit reuses the device copy; a miss copies from pinned host memory on a side
stream, so the transfer overlaps whatever the current stream is computing, and the current stream waits on
an event before it concatenates the batch.

Counting: `hits` / `misses` count distinct known documents per `fetch` (a document repeated inside one batch
is looked up once); `bytes_h2d` counts the la + ca bytes of misses (on a CPU index: the bytes a GPU would
have moved); `dense` counts documents synthesised all-ones for `on_unknown="dense"`, which are never cached.
"""
from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from sift.errors import SiftError
from sift.format import IndexReader, Manifest, ModelGeometry, ca_nbytes, la_nbytes, n_pages
from sift.model import fingerprint as model_fingerprint
from sift.model import resolve_model_dir

from ..kernels.bits import pack_msb
from ..kernels.block_indices import DocBits

_COLUMNS = ["doc_id", "content_hash", "n_tokens", "la_bits", "ca_bits"]
# Optional column (SPEC section 3): the builder's per-document context sensitivity (pipeline/sensitivity.py).
SENSITIVITY = "context_sensitivity"
# What a request may do with a document the index lacks: refuse it, or attend to it densely (SiftIndex.fetch,
# SiftEngine(on_unknown=...)).
ON_UNKNOWN = ("error", "dense")
_NAMES_SHOWN = 5


@dataclass(frozen=True, eq=False)
class DocEntry:
    """One indexed document. la / ca: uint8 [n_layers * n_heads * vector bytes], views of the host buffer
    (pinned when CUDA is available): for layer, for head, one byte-aligned vector (SPEC section 3)."""

    doc_id: str
    n_tokens: int
    content_hash: str
    la: torch.Tensor
    ca: torch.Tensor


def _vector_nbytes(n_tokens: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `la_nbytes` / `ca_nbytes`: int64 [n] bytes of one (layer, head) vector."""
    p = -(-n_tokens.astype(np.int64) // tile)
    return (p * (p + 1) // 2 + 7) // 8, (p + 7) // 8


def _binary_chunks(column: pa.ChunkedArray, where: str, name: str):
    """-> [(offsets int64 [n + 1] into data, data uint8 view)] per chunk, zero-copy from Arrow."""
    out = []
    for chunk in column.chunks:
        if chunk.null_count:
            raise SiftError(f"shard {where} has {chunk.null_count} null {name} value(s): rebuild the index")
        width = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
        _, off_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(off_buf, dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        out.append((offsets.astype(np.int64), data))
    return out


def _host_buffer(chunks_per_shard: list, pin: bool) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Concatenate every chunk's used data once into one owned uint8 buffer.
    -> (buffer uint8 [total], row offsets int64 [rows], row lengths int64 [rows])."""
    total = sum(int(o[-1] - o[0]) for chunks in chunks_per_shard for o, _ in chunks)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    dst = buf.numpy()
    starts, lengths, pos = [], [], 0
    for chunks in chunks_per_shard:
        for offsets, data in chunks:
            n = int(offsets[-1] - offsets[0])
            dst[pos : pos + n] = data[offsets[0] : offsets[-1]]
            starts.append(offsets[:-1] - offsets[0] + pos)
            lengths.append(np.diff(offsets))
            pos += n
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return buf, cat(starts), cat(lengths)


def _token_count(doc_id, n) -> int:
    try:
        count = operator.index(n)
    except TypeError:
        count = -1
    if isinstance(n, bool) or count < 0:
        raise SiftError(f"document {doc_id!r}: n_tokens={n!r} must be an integer >= 0")
    return count


class SiftIndex:
    """A committed generation of a SIFT index, ready to serve (see the module docstring)."""

    def __init__(self, reader: IndexReader, *, hbm_budget_bytes: int, device: torch.device):
        m = reader.manifest
        # The folder (a Path), or the URI without credentials: what messages name.
        self.path: Path | str = reader.location.local_path if reader.location.local else reader.location.uri
        self.manifest: Manifest = m
        self.generation: int = m.generation
        self.tile: int = m.tile
        self.prefix_token_ids: tuple[int, ...] = m.prefix_token_ids
        self.fingerprint: str = m.model.fingerprint
        self.geometry: ModelGeometry = m.model.geometry
        self.n_layers: int = m.model.n_layers
        self.n_heads: int = m.model.n_heads
        self.n_kv_heads: int = m.model.n_kv_heads
        self.head_dim: int = m.model.head_dim
        self.rope: dict = m.model.rope
        self.model_name: str = m.model.name
        self.device = device
        self.budget_bytes = int(hbm_budget_bytes)
        self._load(reader)

        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()  # row -> (la, ca, nbytes)
        self._resident = 0
        self._hits = self._misses = self._bytes_h2d = self._evictions = self._n_dense = 0
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._uploaded: torch.cuda.Event | None = None  # recorded on the side stream after the last upload

    @classmethod
    def open(cls, path: str | Path, *, hbm_budget_bytes: int = 256 << 20, device=None,
             verify: bool = True) -> "SiftIndex":
        """Open the committed generation at `path`, a folder or a URI (s3://, gs://, hdfs://, file://; credentials
        from the environment). device: where `fetch` puts bits (default: the current CUDA device if there is one,
        else CPU). verify: check every shard's sha256 against the manifest."""
        if isinstance(hbm_budget_bytes, bool) or not isinstance(hbm_budget_bytes, int) or hbm_budget_bytes < 0:
            raise SiftError(f"hbm_budget_bytes={hbm_budget_bytes!r} must be an integer >= 0 (0 disables the cache)")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(IndexReader.open(path, verify=verify), hbm_budget_bytes=hbm_budget_bytes, device=device)

    # ---------------------------------------------------------------------------------------------- loading

    def _load(self, reader: IndexReader) -> None:
        ids, hashes, n_tok, la_chunks, ca_chunks, sens = [], [], [], [], [], []
        vectors = self.n_layers * self.n_heads
        for shard in reader.manifest.shards:
            where = reader.show(shard)
            table = reader.read(shard)  # checked to lie inside the index; every column: one is optional
            n = table.column("n_tokens").to_numpy().astype(np.int64)
            la, ca = _binary_chunks(table.column("la_bits"), where, "la_bits"), \
                _binary_chunks(table.column("ca_bits"), where, "ca_bits")
            la_len = np.concatenate([np.diff(o) for o, _ in la]) if la else np.zeros(0, np.int64)
            ca_len = np.concatenate([np.diff(o) for o, _ in ca]) if ca else np.zeros(0, np.int64)
            la_nb, ca_nb = _vector_nbytes(n, self.tile)
            bad = np.flatnonzero((la_len != vectors * la_nb) | (ca_len != vectors * ca_nb) | (n < 0))
            shard_ids = table.column("doc_id").to_pylist()
            if bad.size:
                i = int(bad[0])
                raise SiftError(
                    f"shard {where}: document {shard_ids[i]!r} ({n[i]} tokens, tile {self.tile}) has "
                    f"{la_len[i]} la_bits / {ca_len[i]} ca_bits bytes; {self.n_layers} layers x {self.n_heads} "
                    f"heads need {vectors * la_nb[i]} / {vectors * ca_nb[i]} ({bad.size} bad rows): the shard "
                    f"does not match its manifest; rebuild the index")
            ids += shard_ids
            hashes += table.column("content_hash").to_pylist()
            sens.append(table.column(SENSITIVITY).to_numpy(zero_copy_only=False).astype(np.float64)
                        if SENSITIVITY in table.column_names else np.full(len(shard_ids), np.nan))
            n_tok.append(n)
            la_chunks.append(la)
            ca_chunks.append(ca)

        pin = torch.cuda.is_available()
        self._la_host, self._la_off, self._la_len = _host_buffer(la_chunks, pin)
        self._ca_host, self._ca_off, self._ca_len = _host_buffer(ca_chunks, pin)
        self._n_tokens = np.concatenate(n_tok) if n_tok else np.zeros(0, np.int64)
        self._sensitivity = np.concatenate(sens) if sens else np.zeros(0, np.float64)
        self._doc_ids: list[str] = ids
        self._hashes: list[str] = hashes
        self._row: dict[str, int] = {}
        for r, d in enumerate(ids):
            if d in self._row:
                raise SiftError(f"index {self.path} holds doc_id {d!r} twice: rebuild the index")
            self._row[d] = r

    # ------------------------------------------------------------------------------------------ inspection

    def __contains__(self, doc_id) -> bool:
        return doc_id in self._row

    def __len__(self) -> int:
        return len(self._doc_ids)

    def __repr__(self) -> str:
        return (f"SiftIndex({str(self.path)!r}, generation={self.generation}, documents={len(self)}, "
                f"tile={self.tile}, device={self.device})")

    def entry(self, doc_id: str) -> DocEntry:
        r = self._row.get(doc_id)
        if r is None:
            raise SiftError(self._unknown_message([doc_id]))
        la, ca = self._host_views(r)
        return DocEntry(doc_id=doc_id, n_tokens=int(self._n_tokens[r]), content_hash=self._hashes[r], la=la, ca=ca)

    def sensitivity(self, doc_id: str) -> float | None:
        """The document's context sensitivity (SPEC section 3), None where its shard has no such column (or a
        null) or the index lacks the document."""
        r = self._row.get(doc_id)
        if r is None or np.isnan(self._sensitivity[r]):
            return None
        return float(self._sensitivity[r])

    def _host_views(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        la_off, la_len, ca_off, ca_len = (int(a[r]) for a in (self._la_off, self._la_len, self._ca_off, self._ca_len))
        return self._la_host[la_off : la_off + la_len], self._ca_host[ca_off : ca_off + ca_len]

    def stats(self) -> dict:
        with self._lock:
            return dict(hits=self._hits, misses=self._misses, bytes_h2d=self._bytes_h2d,
                        evictions=self._evictions, resident_bytes=self._resident, budget_bytes=self.budget_bytes,
                        resident_documents=len(self._cache), dense=self._n_dense, documents=len(self))

    def check_model(self, model) -> None:
        """Refuse a served model other than the one the index was built with (SPEC section 3). model: a
        transformers model (its `name_or_path` / `config._name_or_path` is the local folder it came from)."""
        config = getattr(model, "config", None)
        name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
        if not name:
            raise SiftError("cannot check the served model against the index: it has no name_or_path (load it "
                            "from a local folder with from_pretrained)")
        try:
            folder = resolve_model_dir(str(name))
        except SiftError:
            raise SiftError(f"cannot check the served model {str(name)!r} against index {self.path}: it is not a "
                            f"local transformers folder (load it from a folder with a config.json)") from None
        fp = model_fingerprint(folder)
        if fp != self.fingerprint:
            raise SiftError(
                f"index {self.path} was built with model {self.model_name!r} (fingerprint {self.fingerprint}) "
                f"but the served model {str(folder)!r} has fingerprint {fp}: rebuild the index with this model "
                f"(`sift-build CORPUS --model {folder} --out {self.path}`) or serve the model the index was "
                f"built with")
        if config is None:
            return
        served = ModelGeometry.from_config(config)
        if served != self.geometry:
            raise SiftError(
                f"served model (layers, heads, kv heads, head_dim) = {astuple(served)} but index {self.path} was "
                f"built for {astuple(self.geometry)} (same fingerprint {fp}: its config was changed in memory): "
                f"serve the model as saved, or rebuild the index with the changed model")

    # -------------------------------------------------------------------------------------------- fetching

    def _unknown_message(self, unknown: list[str]) -> str:
        shown = ", ".join(repr(d) for d in unknown[:_NAMES_SHOWN])
        more = f" and {len(unknown) - _NAMES_SHOWN} more" if len(unknown) > _NAMES_SHOWN else ""
        return (f"{len(unknown)} document(s) not in index {self.path} (generation {self.generation}): {shown}{more}; "
                f"add them to the corpus and rebuild with `sift-build`, or fetch with on_unknown='dense'")

    def _resolve(self, docs: list[tuple[str, int]], on_unknown: str) -> list[int | None]:
        rows, unknown = [], []
        for doc_id, n in docs:
            r = self._row.get(doc_id)
            if r is None:
                unknown.append(doc_id)
            elif int(self._n_tokens[r]) != int(n):
                raise SiftError(
                    f"document {doc_id!r} has {int(n)} tokens here but {int(self._n_tokens[r])} in index "
                    f"{self.path} (generation {self.generation}): the index is stale for it; rebuild the index "
                    f"(`sift-build` re-profiles changed documents)")
            rows.append(r)
        if unknown and on_unknown == "error":
            raise SiftError(self._unknown_message(list(dict.fromkeys(unknown))))
        return rows

    def _make_room(self, size: int, batch: set[int]) -> bool:
        """Evict least-recently-used documents outside `batch` until `size` more bytes fit the budget.
        False (nothing evicted) when it cannot fit: the document is then served uncached."""
        if size > self.budget_bytes:
            return False
        free = self.budget_bytes - self._resident
        evictable = [r for r in self._cache if r not in batch]  # LRU first
        if free + sum(self._cache[r][2] for r in evictable) < size:
            return False
        for r in evictable:
            if self._resident + size <= self.budget_bytes:
                break
            self._resident -= self._cache.pop(r)[2]
            self._evictions += 1
        return True

    def _upload(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        la, ca = self._host_views(r)
        if self._stream is None:
            return la.to(self.device), ca.to(self.device)
        with torch.cuda.stream(self._stream):  # allocated and copied on the side stream
            return la.to(self.device, non_blocking=True), ca.to(self.device, non_blocking=True)

    def _device_parts(self, rows: list[int | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Device copies of the batch's known documents: cache hits, else uploads (cached when they fit)."""
        batch = {r for r in rows if r is not None}
        parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        uploaded = False
        for r in rows:
            if r is None or r in parts:
                continue
            cached = self._cache.get(r)
            if cached is not None:
                self._cache.move_to_end(r)
                self._hits += 1
                parts[r] = cached[:2]
                continue
            size = int(self._la_len[r] + self._ca_len[r])
            keep = self._make_room(size, batch)
            parts[r] = self._upload(r)
            uploaded = True
            self._misses += 1
            self._bytes_h2d += size
            if keep:
                self._cache[r] = (*parts[r], size)
                self._resident += size
        assert self._resident <= self.budget_bytes, (self._resident, self.budget_bytes)
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            if uploaded:
                self._uploaded = torch.cuda.Event()
                self._uploaded.record(self._stream)
            if self._uploaded is not None:
                # The side stream runs in order, so its last event covers every copy so far, also those of
                # cache hits uploaded while another stream was current (a no-op on the GPU once done).
                current.wait_event(self._uploaded)
            for la, ca in parts.values():
                # The tensors are read on `current`: the allocator must not reuse their memory (on eviction)
                # before those reads have run.
                la.record_stream(current)
                ca.record_stream(current)
        return parts

    def _dense_bits(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All-ones bits of every (layer, head) for a document of n_tokens, trailing bits 0 (SPEC section 2)."""
        p = n_pages(n_tokens, self.tile)
        vectors = self.n_layers * self.n_heads
        la = pack_msb(torch.ones(p * (p + 1) // 2, dtype=torch.bool, device=self.device)).repeat(vectors)
        ca = pack_msb(torch.ones(p, dtype=torch.bool, device=self.device)).repeat(vectors)
        return la, ca

    def fetch(self, docs: Sequence[tuple[str, int]], *, on_unknown: str = "error") -> DocBits:
        """docs: (doc_id, n_tokens) of a batch's documents in the layout's document order (a document may
        repeat) -> their bits on `device`, documents in that order.

        Unknown doc ids raise SiftError, or with on_unknown="dense" get all-ones bits (every tile kept: dense
        attention for that document). A known document with another n_tokens raises (stale index).
        """
        if on_unknown not in ON_UNKNOWN:
            raise SiftError(f"on_unknown={on_unknown!r} must be one of {', '.join(ON_UNKNOWN)}")
        docs = [(doc_id, _token_count(doc_id, n)) for doc_id, n in docs]
        rows = self._resolve(docs, on_unknown)
        with self._lock:
            parts = self._device_parts(rows)
            dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for r, (_, n) in zip(rows, docs):
                if r is None and n not in dense:
                    dense[n] = self._dense_bits(n)
            self._n_dense += sum(r is None for r in rows)
        la_parts, ca_parts, la_nb, ca_nb = [], [], [], []
        for r, (_, n) in zip(rows, docs):
            la, ca = parts[r] if r is not None else dense[n]
            la_parts.append(la)
            ca_parts.append(ca)
            la_nb.append(la_nbytes(n, self.tile))
            ca_nb.append(ca_nbytes(n, self.tile))
        meta = torch.zeros(4, len(docs), dtype=torch.int64)  # la_base, ca_base, la_head_nbytes, ca_head_nbytes
        for i, parts_i in enumerate((la_parts, ca_parts)):
            sizes = torch.tensor([t.numel() for t in parts_i], dtype=torch.int64)
            meta[i] = torch.cumsum(sizes, 0) - sizes
        meta[2] = torch.tensor(la_nb, dtype=torch.int64)
        meta[3] = torch.tensor(ca_nb, dtype=torch.int64)
        meta = meta.to(self.device)
        return DocBits(la_bytes=self._flat(la_parts), ca_bytes=self._flat(ca_parts), la_base=meta[0],
                       ca_base=meta[1], la_head_nbytes=meta[2], ca_head_nbytes=meta[3],
                       n_layers=self.n_layers, n_heads=self.n_heads)

    def _flat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        # One byte at least, so the kernels always get a valid pointer (as `pack_doc_bits` does).
        if sum(t.numel() for t in parts) == 0:
            return torch.zeros(1, dtype=torch.uint8, device=self.device)
        return torch.cat(parts)
