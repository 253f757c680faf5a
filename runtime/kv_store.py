"""The document KV store: each document's position-free K / V, computed once on its own, served to every request
that retrieves it, at any offset, from one physical copy (docs/SPEC.md section 6).

    KVStore(hbm_bytes, dram_bytes)    two budgeted tiers, given to `SiftEngine(..., kv_store=store)`
    store.stats()                     bytes in use and what the tiers did

An entry is one document's K and V of every layer, computed after the index's profiling prefix (the canonical
context), keys rotated at segment-local positions (the form the attention kernels take). Its key is
(model fingerprint, content hash of the token ids, KV dtype, profiling prefix, page size): never a position, so
any request at any offset reads the same bytes.

HBM tier: one pool per K and V, allocated once, `[n_layers, pages * block, Hkv, D]` (token-major: the kernels see a
layer as `[Hkv, slots, D]` through strides), cut into pages of one kernel block. Everything a call attends to lives
there: documents' pages (entries) and the call's own pages (its prefix, query, generated tokens and recomputed
blocks: "scratch", freed when the call ends). DRAM tier: the same layout in pinned host memory, also allocated
once. Pages are handed out as one contiguous run wherever one is free, so one layer of an entry is one contiguous
piece in either tier and moves between them with one large copy. No allocation per request in either tier.

Policy. An entry a running call uses is pinned (reference count) and never evicted. Eviction is LRU in both tiers:
every entry of one model costs the same per token to recompute and to move, so recency is the only signal that
differs between entries (documents of a RAG corpus are a few hundred to a few thousand tokens, where a prefill's
cost is near-linear in tokens). An entry computed on a miss is also written to DRAM on a side stream (write-back
off the critical path), so evicting it from HBM later is free; an HBM entry without a DRAM copy is copied down
before its pages are reused. A DRAM hit is promoted into HBM pages on a side stream, layer by layer, and the
attention of layer l waits only for layer l's copies (`Lease.wait_layer`), so the copies overlap the forward.

On CPU both tiers are host memory and every copy is synchronous; the bookkeeping is the same.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sift.errors import SiftError
from sift.format import ModelGeometry

# Layers of a promotion queued ahead of the layer the forward waits for.
PREFETCH_LAYERS = 2


def entry_key(fingerprint: str, content_hash: str, n_tokens: int, dtype: torch.dtype, prefix_ids, block: int) -> str:
    """The store key of a document's KV: everything that changes its bytes, never its position."""
    prefix = hashlib.sha256(np.asarray(list(prefix_ids), dtype=np.int64).tobytes()).hexdigest()[:16]
    return f"{fingerprint}:{content_hash}:{n_tokens}:{str(dtype).removeprefix('torch.')}:{prefix}:{block}"


@dataclass(frozen=True)
class Geometry:
    """What the pool's shape depends on: fixed when the store is attached to an engine."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: ModelGeometry, block: int, dtype: torch.dtype, device: torch.device) -> "Geometry":
        """The pool geometry of a model (its layers, KV heads and head_dim) at a kernel block and KV dtype."""
        return cls(model.n_layers, model.n_kv_heads, model.head_dim, block, dtype, torch.device(device))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of one block of tokens, every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.block * self.head_dim * torch.finfo(self.dtype).bits // 8


@dataclass(eq=False)
class _Entry:
    key: str
    n_tokens: int
    n_pages: int
    pages: np.ndarray | None = None        # int64 [n_pages] HBM pages, None when not in HBM
    pages_t: torch.Tensor | None = None    # the same on the pool's device, made once per stay in HBM (a hit
                                           # makes no host-to-device copy)
    host: np.ndarray | None = None         # int64 [n_pages] DRAM pages, None when not in DRAM
    host_done: torch.cuda.Event | None = None  # the write-back's completion (CUDA)
    refs: int = 0
    committed: bool = False                # its KV is whole (False while the call that computes it runs)


@dataclass(eq=False)
class Lease:
    """The pages one call attends to, pinned until `release`.

    doc_pages: int64 [n_pages] per distinct document key; status: "hbm" | "dram" | "miss" per key; misses: keys
    the call must compute (their pages are allocated, not yet written); scratch: the call's own pages."""

    store: "KVStore"
    doc_pages: dict[str, torch.Tensor]
    status: dict[str, str]
    scratch: torch.Tensor
    layer_ready: "_Promotion | None" = None  # the promotions' per-layer copies (None: nothing to wait for)
    _entries: list = field(default_factory=list)
    _scratch_np: np.ndarray | None = None
    _released: bool = False

    @property
    def misses(self) -> list[str]:
        return [k for k, s in self.status.items() if s == "miss"]

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` of the promoted entries (no-op on CPU / when none),
        after queueing the copies of the layers PREFETCH_LAYERS ahead: the host queues a layer's copies while
        the GPU still runs earlier ones, so queueing never delays the forward's start."""
        if self.layer_ready is not None:
            self.layer_ready.queue_through(layer + PREFETCH_LAYERS)
            torch.cuda.current_stream(self.store.geometry.device).wait_event(self.layer_ready.events[layer])

    def commit(self) -> None:
        """The misses' KV is written: keep them (and start their write-back to DRAM)."""
        self.store._commit(self)

    def release(self) -> None:
        """Unpin every entry and free the scratch pages; misses never committed are dropped."""
        if not self._released:
            self._released = True
            self.store._release(self)


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory for this process: the machine's, capped by its cgroup's limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    with contextlib.suppress(OSError, ValueError, StopIteration):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = int(next(line for line in meminfo if line.startswith("MemAvailable:")).split()[1]) * 1024
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            total = min(total, int(Path(limit_file).read_text().split()[0]))  # "max": no limit (ValueError)
    return total, min(available, total)


def _check_budget(what: str, need: int, have: int, where: str, knob: str) -> None:
    if need > have:
        raise SiftError(f"KVStore {what} bytes ({need / 2**30:.2f} GiB) is more than {where} ({have / 2**30:.2f} "
                        f"GiB): lower {knob}")


class KVStore:
    """Budgeted HBM + DRAM store of documents' position-free KV (module docstring).

    hbm_bytes: the HBM pool's size (rounded down to whole pages; it also holds each call's own prefix / query /
    generated pages). dram_bytes: the pinned host tier (0: an entry evicted from HBM is dropped). The device,
    dtype and shape come from the engine's model when `SiftEngine(..., kv_store=store)` attaches it."""

    def __init__(self, hbm_bytes: int, dram_bytes: int = 0):
        for name, value in (("hbm_bytes", hbm_bytes), ("dram_bytes", dram_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SiftError(f"{name}={value!r} must be an integer number of bytes >= 0")
        # A budget no memory here can hold is refused now, not when an engine allocates it. Without a GPU both
        # tiers are host memory.
        host = _host_memory()[0]
        if torch.cuda.is_available():
            gpu = max(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
            _check_budget(f"hbm_bytes={hbm_bytes}", hbm_bytes, gpu, "the largest GPU here holds", "hbm_bytes")
            _check_budget(f"dram_bytes={dram_bytes}", dram_bytes, host, "this host's memory", "dram_bytes")
        else:
            _check_budget(f"hbm_bytes + dram_bytes = {hbm_bytes} + {dram_bytes}", hbm_bytes + dram_bytes, host,
                          "this host's memory (without a GPU both tiers are host memory)", "hbm_bytes or dram_bytes")
        self.hbm_bytes, self.dram_bytes = hbm_bytes, dram_bytes
        self.geometry: Geometry | None = None
        self.fingerprint: str | None = None
        self.k_pool = self.v_pool = None              # [n_layers, pages * block, Hkv, D]
        self.k_host = self.v_host = None              # the DRAM tier, same layout
        self.page_valid: torch.Tensor | None = None  # int32 [pages]: real slots of each page (decode reads it)
        self._free: np.ndarray | None = None          # bool [pages]
        self._host_free: np.ndarray | None = None     # bool [DRAM pages]
        self._hbm: OrderedDict[str, _Entry] = OrderedDict()   # entries with pages, LRU first
        self._dram: OrderedDict[str, _Entry] = OrderedDict()  # entries with a host copy, LRU first
        self._lock = threading.RLock()
        self._stream = None
        self._scratch = 0                             # pages held as scratch by unreleased leases
        self._counts = dict(hits_hbm=0, hits_dram=0, misses=0, evictions=0, evictions_dram=0, demotions=0,
                            bytes_h2d=0, bytes_d2h=0)

    # ------------------------------------------------------------------------------------------- set-up

    def attach(self, geometry: Geometry, fingerprint: str) -> None:
        """Allocate the pool for this model (once); a store serves one model geometry only."""
        with self._lock:
            if self.geometry is not None:
                if geometry != self.geometry or fingerprint != self.fingerprint:
                    raise SiftError(f"this KVStore already serves another model or KV layout ({self.geometry}); "
                                    f"create one KVStore per engine")
                return
            pages = self.hbm_bytes // geometry.page_bytes
            if pages < 1:
                raise SiftError(f"KVStore hbm_bytes={self.hbm_bytes} holds no page of {geometry.page_bytes} bytes "
                                f"(one {geometry.block}-token block of K and V, every layer): raise hbm_bytes")
            g = geometry
            host_pages = self.dram_bytes // g.page_bytes
            self._check_free(g, pages * g.page_bytes, host_pages * g.page_bytes)
            shape = (g.n_layers, pages * g.block, g.n_kv_heads, g.head_dim)
            host_shape = (g.n_layers, host_pages * g.block, g.n_kv_heads, g.head_dim)
            pin = g.device.type == "cuda"
            try:
                k_pool = torch.zeros(shape, dtype=g.dtype, device=g.device)
                v_pool = torch.zeros(shape, dtype=g.dtype, device=g.device)
                k_host = torch.empty(host_shape, dtype=g.dtype, pin_memory=pin)
                v_host = torch.empty(host_shape, dtype=g.dtype, pin_memory=pin)
            except RuntimeError as e:  # torch.OutOfMemoryError included
                reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                raise SiftError(f"cannot allocate the KVStore (hbm_bytes={self.hbm_bytes} on {g.device}, "
                                f"dram_bytes={self.dram_bytes} on the host): {reason[:200]}: lower hbm_bytes or "
                                f"dram_bytes") from None
            self.k_pool, self.v_pool, self.k_host, self.v_host = k_pool, v_pool, k_host, v_host
            self.page_valid = torch.zeros(pages, dtype=torch.int32, device=g.device)
            self._free = np.ones(pages, dtype=bool)
            self._host_free = np.ones(host_pages, dtype=bool)
            self.geometry, self.fingerprint = g, fingerprint
            if g.device.type == "cuda":
                self._stream = torch.cuda.Stream(device=g.device)

    def _check_free(self, g: Geometry, pool_bytes: int, host_bytes: int) -> None:
        """Refuse pools the memory free now cannot hold (host memory is checked rather than allocated: an
        over-committed allocation would succeed, then get the process killed when the pool is first written)."""
        available = _host_memory()[1]
        if g.device.type == "cuda":
            free = torch.cuda.mem_get_info(g.device)[0]
            _check_budget(f"hbm_bytes={self.hbm_bytes}", pool_bytes, free, f"{g.device} has free", "hbm_bytes")
            _check_budget(f"dram_bytes={self.dram_bytes}", host_bytes, available, "this host has available",
                          "dram_bytes")
        else:
            _check_budget(f"hbm_bytes + dram_bytes = {self.hbm_bytes} + {self.dram_bytes}", pool_bytes + host_bytes,
                          available, "this host has available", "hbm_bytes or dram_bytes")

    @property
    def n_pages(self) -> int:
        return 0 if self._free is None else len(self._free)

    def _entry_bytes(self, e: _Entry) -> int:
        return e.n_pages * self.geometry.page_bytes

    def stats(self) -> dict:
        """hbm_bytes / dram_bytes: bytes in use (entries' pages in HBM, pinned host copies); entries per tier;
        hits_hbm / hits_dram / misses: distinct documents per call; evictions (HBM), evictions_dram,
        demotions (HBM -> DRAM copies made at eviction), bytes_h2d / bytes_d2h: KV bytes moved; pages_free: HBM
        pages no entry and no call holds; pages_scratch: pages calls hold for their own tokens."""
        with self._lock:
            page = self.geometry.page_bytes if self.geometry else 0
            used = sum(e.n_pages for e in self._hbm.values())
            host_used = sum(e.n_pages for e in self._dram.values())
            host_pages = len(self._host_free) if self._host_free is not None else 0
            return dict(hbm_bytes=used * page, dram_bytes=host_used * page, hbm_capacity=self.n_pages * page,
                        dram_capacity=host_pages * page, entries_hbm=len(self._hbm), entries_dram=len(self._dram),
                        pinned=sum(e.refs > 0 for e in {**self._dram, **self._hbm}.values()),
                        pages_free=0 if self._free is None else int(self._free.sum()), pages_scratch=self._scratch,
                        **self._counts)

    def clear(self, *, hbm: bool = True, dram: bool = True) -> None:
        """Drop every entry no call is using from HBM and / or DRAM (an entry dropped from HBM stays served
        from DRAM when it has a copy there). For operations and benchmarks: e.g. `clear(dram=False)` leaves
        every document DRAM-warm."""
        with self._lock:
            if hbm:
                while self._evict_one(demote=False):
                    pass
            if dram:
                for e in [e for e in self._dram.values() if e.refs == 0]:
                    self._drop_host(e)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._hbm or key in self._dram

    # ---------------------------------------------------------------------------------------- leasing

    def can_lease(self, docs: dict[str, int], scratch_pages: int, per_miss_pages: int = 0) -> bool:
        """Whether leases of `docs` (distinct key -> n_tokens) and `scratch_pages` own pages in all (plus
        per_miss_pages per document missing from both tiers) would find their pages now: free, or held by
        entries no call uses (other than these documents). When they would, the documents already in HBM become
        the most recently used, so that taking the leases one after another evicts none of them."""
        g = self.geometry
        with self._lock:
            need = scratch_pages
            for key, n in docs.items():
                if key not in self._hbm:
                    need += -(-n // g.block) + (0 if key in self._dram else per_miss_pages)
            spare = int(self._free.sum()) + sum(e.n_pages for k, e in self._hbm.items()
                                                if e.refs == 0 and k not in docs)
            if need > spare:
                return False
            for key in docs:
                if key in self._hbm:
                    self._hbm.move_to_end(key)
            return True

    def lease(self, docs: dict[str, int], scratch_pages: int, per_miss_pages: int = 0) -> Lease:
        """docs: distinct document key -> n_tokens; scratch_pages: the call's own pages, plus per_miss_pages
        more for each document the store misses (after the others in `Lease.scratch`). Pins the documents,
        allocates pages for misses and DRAM hits (evicting LRU entries) and starts the promotions. Raises
        SiftError before any work when the pool cannot hold the call."""
        g = self.geometry
        with self._lock:
            misses = sum(key not in self._hbm and key not in self._dram for key in docs)
            scratch_pages += per_miss_pages * misses
            need = scratch_pages + sum(-(-n // g.block) for n in docs.values())
            if need > self.n_pages:
                raise SiftError(
                    f"this batch needs {need} KV pages ({need * g.page_bytes / 2**30:.2f} GiB: its documents plus its "
                    f"prefix, query and generated tokens) but the KVStore's HBM pool holds {self.n_pages} "
                    f"({self.hbm_bytes / 2**30:.2f} GiB): raise KVStore(hbm_bytes=...) or send fewer or shorter "
                    f"requests per call")
            entries, status = [], {}
            for key, n in docs.items():
                e = self._hbm.get(key) or self._dram.get(key)
                if e is not None and e.n_tokens != n:
                    raise SiftError(f"KV store entry {key[:40]}... holds {e.n_tokens} tokens, the request {n}")
                if e is None:
                    e = _Entry(key, n, -(-n // g.block))
                    status[key] = "miss"
                else:
                    status[key] = "hbm" if e.pages is not None else "dram"
                e.refs += 1
                entries.append(e)
            lease = Lease(self, {}, status, torch.empty(0, dtype=torch.int64), _entries=entries)
            try:
                self._place(lease, scratch_pages)
            except BaseException:
                self._release(lease)
                raise
            return lease

    def _place(self, lease: Lease, scratch_pages: int) -> None:
        promote = []
        for e in lease._entries:
            st = lease.status[e.key]
            if st == "hbm":
                self._hbm.move_to_end(e.key)
                self._counts["hits_hbm"] += 1
            else:
                e.pages = self._allocate(e.n_pages)
                self._hbm[e.key] = e
                self._set_valid(e.pages, e.n_tokens)
                if st == "dram":
                    self._dram.move_to_end(e.key)
                    self._counts["hits_dram"] += 1
                    promote.append(e)
                else:
                    self._counts["misses"] += 1
            if e.pages_t is None:
                e.pages_t = torch.as_tensor(e.pages, device=self.geometry.device)
            lease.doc_pages[e.key] = e.pages_t
        scratch = self._allocate(scratch_pages)
        self.page_valid[torch.as_tensor(scratch, device=self.geometry.device)] = 0
        lease.scratch = torch.as_tensor(scratch, device=self.geometry.device)
        lease._scratch_np = scratch
        self._scratch += len(scratch)
        if promote:
            lease.layer_ready = self._promote(promote)

    def _set_valid(self, pages: np.ndarray, n_tokens: int) -> None:
        b = self.geometry.block
        valid = torch.full((len(pages),), b, dtype=torch.int32)
        valid[-1] = n_tokens - (len(pages) - 1) * b
        self.page_valid[torch.as_tensor(pages, device=self.geometry.device)] = valid.to(self.geometry.device)

    def _allocate(self, n: int) -> np.ndarray:
        """n free HBM pages (evicting LRU entries as needed)."""
        while int(self._free.sum()) < n:
            if not self._evict_one():
                raise SiftError(f"the KVStore's HBM pool has no {n} free pages: every entry is in use by this call; "
                                f"raise KVStore(hbm_bytes=...)")
        return _take(self._free, n)

    def _evict_one(self, demote: bool = True) -> bool:
        """Evict the least recently used unpinned HBM entry (copied down to DRAM first if it has no copy there).
        False when every HBM entry is pinned."""
        key = next((k for k, e in self._hbm.items() if e.refs == 0), None)
        if key is None:
            return False
        e = self._hbm.pop(key)
        if e.host is None and demote:
            self._write_back(e, synchronous=True)
        elif e.host_done is not None:
            # The pages are reused by work on the current stream: the write-back must have read them.
            torch.cuda.current_stream(self.geometry.device).wait_event(e.host_done)
        self._free[e.pages] = True
        e.pages, e.pages_t = None, None
        self._counts["evictions"] += 1
        return True

    # -------------------------------------------------------------------------------------- the tiers

    def _copy(self, dst_pages: np.ndarray, src_pages: np.ndarray, dst, src, layers, non_blocking: bool) -> None:
        """Copy an entry's pages between tiers, layer by layer: one copy per layer and contiguous run of both
        page lists (the whole entry when both are one run)."""
        blk = self.geometry.block
        for d0, s0, n in _runs(dst_pages, src_pages):
            d, s_ = slice(d0 * blk, (d0 + n) * blk), slice(s0 * blk, (s0 + n) * blk)
            for layer in layers:
                dst[0][layer, d].copy_(src[0][layer, s_], non_blocking=non_blocking)
                dst[1][layer, d].copy_(src[1][layer, s_], non_blocking=non_blocking)

    def _make_dram_room(self, n: int, keep: _Entry) -> bool:
        """Free DRAM pages for n more (dropping LRU entries no call uses); False when they cannot be had."""
        if n > len(self._host_free):
            return False
        for key in list(self._dram):
            if int(self._host_free.sum()) >= n:
                break
            e = self._dram[key]
            if e.refs or e is keep:
                continue
            self._drop_host(e)
        return int(self._host_free.sum()) >= n

    def _drop_host(self, e: _Entry) -> None:
        if e.host_done is not None:
            e.host_done.synchronize()   # its pages are rewritten next: the write-back must have finished
        self._dram.pop(e.key)
        self._host_free[e.host] = True
        e.host, e.host_done = None, None
        self._counts["evictions_dram"] += 1

    def _write_back(self, e: _Entry, *, synchronous: bool) -> None:
        """Copy an HBM entry into DRAM pages (when DRAM has room; else it is simply dropped at eviction).
        Asynchronous on the side stream unless `synchronous` (eviction: its pages are reused next)."""
        if not self._make_dram_room(e.n_pages, e):
            return
        g = self.geometry
        cuda = g.device.type == "cuda"
        host = _take(self._host_free, e.n_pages)
        stream = self._stream if cuda and not synchronous else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._copy(host, e.pages, (self.k_host, self.v_host), (self.k_pool, self.v_pool), range(g.n_layers), cuda)
            if cuda:
                e.host_done = torch.cuda.Event()
                e.host_done.record()
        e.host = host
        self._dram[e.key] = e
        self._counts["bytes_d2h"] += self._entry_bytes(e)
        if synchronous:
            self._counts["demotions"] += 1

    def _promote(self, entries: list[_Entry]) -> "_Promotion | None":
        """DRAM -> the entries' new HBM pages, layer by layer: synchronous on CPU (-> None); on CUDA a
        `_Promotion` that queues them on the side stream, the first layers now and the others as the forward
        reaches them (`Lease.wait_layer`)."""
        self._counts["bytes_h2d"] += sum(self._entry_bytes(e) for e in entries)
        promotion = _Promotion(self, entries)
        if self.geometry.device.type != "cuda":
            promotion.queue_through(self.geometry.n_layers - 1)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.geometry.device))  # the pages' previous readers
        promotion.queue_through(PREFETCH_LAYERS)
        return promotion

    # ------------------------------------------------------------------------------------ end of a call

    def _commit(self, lease: Lease) -> None:
        with self._lock:
            for e in lease._entries:
                if lease.status[e.key] == "miss" and not e.committed:
                    e.committed = True
                    self._write_back(e, synchronous=False)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease.layer_ready is not None:   # a call that stopped early: its promotions still complete
                lease.layer_ready.queue_through(self.geometry.n_layers - 1)
            for e in lease._entries:
                e.refs -= 1
                if not e.committed and e.refs == 0 and self._hbm.get(e.key) is e:
                    # a miss whose call failed before its KV was whole: never served
                    self._hbm.pop(e.key)
                    self._free[e.pages] = True
                    e.pages, e.pages_t = None, None
            if lease._scratch_np is not None:
                self._free[lease._scratch_np] = True
                self._scratch -= len(lease._scratch_np)



class _Promotion:
    """The copies of one call's DRAM hits into their HBM pages, queued layer by layer; `events[l]` is recorded
    (on the side stream) after layer l's copies. The entries are pinned by the call, so their pages in both tiers
    stay theirs until the call ends."""

    def __init__(self, store: KVStore, entries: list[_Entry]):
        self.store, self.entries = store, entries
        self.events: list = []

    def queue_through(self, last: int) -> None:
        store = self.store
        g = store.geometry
        cuda = g.device.type == "cuda"
        with torch.cuda.stream(store._stream) if cuda else contextlib.nullcontext():
            for layer in range(len(self.events), min(last, g.n_layers - 1) + 1):
                for e in self.entries:
                    store._copy(e.pages, e.host, (store.k_pool, store.v_pool), (store.k_host, store.v_host),
                                (layer,), cuda)
                ev = torch.cuda.Event() if cuda else None
                if cuda:
                    ev.record()
                self.events.append(ev)


def _take(free: np.ndarray, n: int) -> np.ndarray:
    """Mark n free pages of `free` (bool, True = free) taken: the first contiguous run that holds them all where
    there is one, else the first n free pages. The caller made sure n are free."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.flatnonzero(free)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1)
    run = next((r for r in runs if len(r) >= n), None)
    pages = (run[:n] if run is not None else idx[:n]).astype(np.int64)
    free[pages] = False
    return pages


def _runs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int]]:
    """(a[i], b[i], length) of each maximal stretch where both page lists are consecutive."""
    if len(a) == 0:
        return []
    cuts = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(a)]])
    return [(int(a[i]), int(b[i]), int(j - i)) for i, j in zip(starts, ends)]
