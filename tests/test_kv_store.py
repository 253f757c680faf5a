"""The document KV store's bookkeeping (runtime/kv_store.py) on CPU: budgets, pinning, LRU across the two tiers,
and that every hit finds its own document's bytes after any sequence of evictions, demotions and promotions.

A "document" here is a key and a length; "computing" it fills its pages with a pattern derived from the key
alone (every element of layer l equals key_id * 100 + l, K and V negated), so a hit whose pages held anything
else - another document, a stale copy, a half promotion - is caught by comparing with that pattern.
"""
import os
import random

import numpy as np
import pytest
import torch

from sift.errors import SiftError
from sift.runtime.kv_store import Geometry, KVStore

GEOM = Geometry(n_layers=3, n_kv_heads=2, head_dim=4, block=4, dtype=torch.float32, device=torch.device("cpu"))
PAGE = GEOM.page_bytes  # 2 * 3 * 2 * 4 * 4 * 4 bytes


def make(hbm_pages: int, dram_pages: int) -> KVStore:
    store = KVStore(hbm_bytes=hbm_pages * PAGE + PAGE // 2, dram_bytes=dram_pages * PAGE)
    store.attach(GEOM, "fp")
    return store


def pattern(doc: int, layer: int) -> float:
    return float(doc * 100 + layer)


def token_slots(lease, key: str, n_tokens: int):
    """(layer, pool slots of the document's real tokens in one of its pages) for every layer and page."""
    for layer in range(GEOM.n_layers):
        for p, page in enumerate(lease.doc_pages[key].tolist()):
            valid = min(GEOM.block, n_tokens - p * GEOM.block)
            yield layer, slice(page * GEOM.block, page * GEOM.block + valid)


def compute(store: KVStore, lease, key: str, doc: int, n_tokens: int) -> None:
    """What the engine's cold forward does: write the document's KV into its pages."""
    for layer, sl in token_slots(lease, key, n_tokens):
        store.k_pool[layer, sl] = pattern(doc, layer)
        store.v_pool[layer, sl] = -pattern(doc, layer)


def check_bytes(store: KVStore, lease, key: str, doc: int, n_tokens: int) -> None:
    for layer, sl in token_slots(lease, key, n_tokens):
        assert torch.all(store.k_pool[layer, sl] == pattern(doc, layer)), (key, layer, sl)
        assert torch.all(store.v_pool[layer, sl] == -pattern(doc, layer)), (key, layer, sl)
    valid = store.page_valid[lease.doc_pages[key]].tolist()
    assert sum(valid) == n_tokens and all(v == GEOM.block for v in valid[:-1])


def test_miss_then_hit_and_stats():
    store = make(hbm_pages=8, dram_pages=8)
    lease = store.lease({"a": 6, "b": 3}, scratch_pages=2, per_miss_pages=1)
    assert lease.status == {"a": "miss", "b": "miss"} and sorted(lease.misses) == ["a", "b"]
    assert len(lease.doc_pages["a"]) == 2 and len(lease.doc_pages["b"]) == 1 and len(lease.scratch) == 2 + 2
    pages = torch.cat([lease.doc_pages["a"], lease.doc_pages["b"], lease.scratch]).tolist()
    assert len(set(pages)) == 7  # disjoint
    compute(store, lease, "a", 1, 6)
    compute(store, lease, "b", 2, 3)
    lease.commit()
    lease.release()
    again = store.lease({"b": 3, "a": 6}, scratch_pages=1, per_miss_pages=1)
    assert again.status == {"b": "hbm", "a": "hbm"} and len(again.scratch) == 1   # no miss: no page for a prefix
    check_bytes(store, again, "a", 1, 6)
    check_bytes(store, again, "b", 2, 3)
    again.release()
    s = store.stats()
    assert (s["hits_hbm"], s["misses"], s["entries_hbm"], s["pinned"]) == (2, 2, 2, 0)
    assert s["hbm_bytes"] == 3 * PAGE and s["dram_bytes"] == 3 * PAGE  # written back on commit


def test_uncommitted_misses_are_dropped():
    """A call that fails before its documents' KV is whole never leaves them in the store."""
    store = make(hbm_pages=4, dram_pages=4)
    lease = store.lease({"a": 5}, scratch_pages=1)
    lease.release()
    assert "a" not in store and store.stats()["hbm_bytes"] == 0
    assert store.lease({"a": 5}, scratch_pages=0).status == {"a": "miss"}


def test_too_small_budget_is_refused_before_any_work():
    store = make(hbm_pages=4, dram_pages=4)
    with pytest.raises(SiftError, match=r"needs 5 KV pages .* holds 4 .*raise KVStore\(hbm_bytes=\.\.\.\)"):
        store.lease({"a": 8, "b": 4}, scratch_pages=2)
    s = store.stats()
    assert s["misses"] == 0 and s["entries_hbm"] == 0 and s["pinned"] == 0
    with pytest.raises(SiftError, match="holds no page"):
        KVStore(hbm_bytes=PAGE - 1).attach(GEOM, "fp")
    with pytest.raises(SiftError, match="hbm_bytes=-1 must be"):
        KVStore(hbm_bytes=-1)


def test_pinned_entries_survive_eviction_then_demote_and_promote():
    store = make(hbm_pages=4, dram_pages=6)
    held = store.lease({"a": 8}, scratch_pages=0)          # pages 2 of 4, held by a running call
    compute(store, held, "a", 1, 8)
    held.commit()
    other = store.lease({"b": 8}, scratch_pages=0)
    compute(store, other, "b", 2, 8)
    other.commit()
    other.release()
    # c needs 2 pages: only b is evictable (a is pinned)
    third = store.lease({"c": 8}, scratch_pages=0)
    assert "a" in store._hbm and "b" not in store._hbm and "b" in store._dram
    check_bytes(store, held, "a", 1, 8)
    with pytest.raises(SiftError, match="needs 6 KV pages"):
        store.lease({"d": 16}, scratch_pages=2)
    compute(store, third, "c", 3, 8)
    third.commit()
    third.release()
    held.release()
    back = store.lease({"b": 8}, scratch_pages=0)           # DRAM hit, promoted into freed pages
    assert back.status == {"b": "dram"}
    check_bytes(store, back, "b", 2, 8)
    back.release()
    assert store.stats()["hits_dram"] == 1 and store.stats()["pinned"] == 0


def test_random_trace_keeps_budgets_refcounts_and_bytes():
    """A long random trace: budgets are never exceeded, HBM entries never share a page, refcounts return to
    zero, and every hit (HBM or promoted from DRAM) holds its own document's bytes."""
    rng = random.Random(7)
    store = make(hbm_pages=24, dram_pages=20)
    lengths = {f"d{i}": rng.randint(1, 22) for i in range(40)}
    doc_num = {k: i + 1 for i, k in enumerate(lengths)}
    outstanding = []
    for step in range(600):
        if outstanding and (len(outstanding) > 2 or rng.random() < 0.4):
            lease = outstanding.pop(rng.randrange(len(outstanding)))
            lease.release()
        else:
            keys = rng.sample(list(lengths), rng.randint(1, 3))
            try:
                lease = store.lease({k: lengths[k] for k in keys}, scratch_pages=rng.randint(0, 2))
            except SiftError:
                continue  # everything evictable is held by outstanding calls
            for k in keys:
                if lease.status[k] == "miss":
                    compute(store, lease, k, doc_num[k], lengths[k])
                else:
                    check_bytes(store, lease, k, doc_num[k], lengths[k])
            if rng.random() < 0.9:
                lease.commit()
            outstanding.append(lease)
        s = store.stats()
        assert s["hbm_bytes"] <= s["hbm_capacity"] and s["dram_bytes"] <= s["dram_capacity"]
        owned = np.concatenate([e.pages for e in store._hbm.values()] + [np.zeros(0, dtype=np.int64)])
        assert len(owned) == len(set(owned.tolist()))
        assert not store._free[owned].any()
    for lease in outstanding:
        lease.release()
    s = store.stats()
    assert s["pinned"] == 0 and all(e.refs == 0 for e in {**store._dram, **store._hbm}.values())
    assert s["hits_hbm"] > 50 and s["hits_dram"] > 10 and s["evictions"] > 20, s
    print(s)


def test_geometry_of_a_model_config():
    """The one model geometry (sift.format.ModelGeometry) from transformers configs of each kind, and the pool
    geometry built on it: GQA, head_dim given explicitly or implied by hidden_size, no num_key_value_heads."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen3Config

    from sift.format import ModelGeometry, ModelIdentity

    gqa = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert ModelGeometry.from_config(gqa) == ModelGeometry(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64)
    explicit = Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                           head_dim=128)
    assert ModelGeometry.from_config(explicit) == ModelGeometry(2, 4, 1, 128)
    old = SimpleNamespace(num_hidden_layers=5, num_attention_heads=6, hidden_size=384, model_type="gpt")
    assert ModelGeometry.from_config(old) == ModelGeometry(5, 6, 6, 64)
    identity = ModelIdentity.from_config("m", "fp", gqa)
    assert identity.geometry == ModelGeometry.from_config(gqa) and identity.head_dim == 64
    pool = Geometry.of(identity.geometry, 16, torch.float16, "cpu")
    assert pool == Geometry(n_layers=3, n_kv_heads=2, head_dim=64, block=16, dtype=torch.float16,
                            device=torch.device("cpu"))
    assert pool.page_bytes == 2 * 3 * 2 * 16 * 64 * 2


# ------------------------------------------------------------------------------------ budgets the memory cannot hold


def test_budget_beyond_the_memory_here_is_refused_at_creation():
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 << 50 > host  # a petabyte: more than any host or GPU of this decade
    for kwargs, knob in ((dict(hbm_bytes=1 << 50), "hbm_bytes"), (dict(hbm_bytes=0, dram_bytes=1 << 50), "dram_bytes")):
        with pytest.raises(SiftError, match=f"{knob}.*1125899906842624.* is more than .*: lower .*{knob}") as refused:
            KVStore(**kwargs)
        assert "\n" not in str(refused.value)
    KVStore(hbm_bytes=host // 8, dram_bytes=host // 8)  # a budget that fits is accepted (and not allocated yet)


def test_budget_beyond_the_memory_free_now_is_refused_at_attach(monkeypatch):
    from sift.runtime import kv_store

    store = KVStore(hbm_bytes=8 * PAGE)
    monkeypatch.setattr(kv_store, "_host_memory", lambda: (1 << 40, 4 * PAGE))  # only 4 pages available now
    with pytest.raises(SiftError, match="more than this host has available .*: lower hbm_bytes"):
        store.attach(GEOM, "fp")
    assert store.geometry is None and store.k_pool is None


def test_failed_allocation_is_a_sift_error(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] can't allocate memory: you tried to allocate 8 bytes")

    store = KVStore(hbm_bytes=8 * PAGE)
    monkeypatch.setattr(torch, "zeros", no_memory)
    with pytest.raises(SiftError, match="cannot allocate the KVStore .*can't allocate memory.*lower hbm_bytes"):
        store.attach(GEOM, "fp")
    monkeypatch.undo()
    store.attach(GEOM, "fp")  # nothing half-made stays behind: the store attaches once memory is there
    assert store.n_pages == 8
