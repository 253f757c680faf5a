"""Mask (b) of the attention benchmark: real SmolLM2 SIFT bits tiled to a long context, decoded by the runtime.

    from masks import real_mask          # bench/ on sys.path (or: from bench.masks import real_mask)
    layout, indptr, indices, stats = real_mask(16384)

Geometry (mirrors mask (a) of bench_attention.py, one request, block 128): `context` tokens = a prefix of
`prefix` tokens + documents of 2048 tokens + a query of `query` tokens; the documents take the stored real ones
in order, cycling (`bench/data/smollm2-wiki2048-bits.parquet`, 24 documents of exactly 2048 tokens, made by
`bench/real_bits.py`); the last document is cut to the tokens left so that the prompt has exactly `context`
tokens. With the defaults (prefix 128 = one block, query 512) every segment is whole blocks and the layout has
exactly context / 128 blocks, like mask (a); the prefix block plays the role of mask (a)'s "first page of the
sequence, kept by every row" (SPEC section 4: document rows see the whole prefix), so the documents start one block later and the last one
has 1408 tokens where mask (a)'s has 1536 (prefix=0 gives mask (a)'s exact segment boundaries, but then no
column is kept by every row).

Cutting the last document: its LA bits are the first P'(P'+1)/2 bits of the full document's (tile rows are
row-major and, attention being causal, tile row i only sees keys < (i+1)T, so for a cut at a multiple of the
tile this equals profiling the cut document: real_bits.py checks it, 0 of 81,000 bits differ); its CA bits are
the first P' pages of the full document's, which no row reads (only query rows, dense, come after the last
document). A cut inside a tile keeps the full tile's bit (a superset; not needed at the default sizes).

Heads: SmolLM2 has 30 layers x 9 query heads (3 KV heads); the benchmark layer has `n_heads` (32). `layer=None`
(default) spreads the query heads evenly over all 270 (layer, head) vectors, layer-major: head h takes vector
floor(h * 270 / n_heads), so the mask has the model's average sparsity across depth. `layer=l` takes layer l's
9 heads, cycled (h -> h % 9). `stats["heads"]` lists the (layer, head) each query head took.

Decoding is the runtime's: `pack_doc_bits` then `block_indices` (Triton) on CUDA, or `block_indices_ref` (its
ref twin) on CPU; the index tile (64) is coarsened to the kernel block (128) by the decode itself.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch

from sift.format import ca_nbytes, la_nbytes, n_pages
from sift.kernels.bits import pack_msb, unpack_msb
from sift.kernels.block_indices import block_indices, block_indices_ref, pack_doc_bits
from sift.kernels.layout import DOC, PREFIX, QUERY, BatchLayout, build_layout

DATA = Path(__file__).resolve().parent / "data" / "smollm2-wiki2048-bits.parquet"
META_KEY = b"sift_real_bits"


class StoredBits(NamedTuple):
    """The stored documents: SPEC section 3 blobs (n_layers x n_heads vectors each) and their lengths."""

    n_tokens: list[int]
    la: list[bytes]
    ca: list[bytes]
    tile: int
    n_layers: int
    n_heads: int
    meta: dict


class RealMask(NamedTuple):
    layout: BatchLayout  # one request; layout.block_valid / block_offset are the kernel's per-block inputs
    indptr: torch.Tensor  # int32 [n_heads * NB + 1], rows head-major (h * NB + query block)
    indices: torch.Tensor  # int32 [indptr[-1]], key blocks ascending per row
    stats: dict


@functools.lru_cache(maxsize=2)
def load_bits(path: str | Path = DATA) -> StoredBits:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["n_tokens", "la_bits", "ca_bits"])
    meta = json.loads(table.schema.metadata[META_KEY])
    model, profile = meta["model"], meta["profile"]
    return StoredBits(n_tokens=table.column("n_tokens").to_pylist(), la=table.column("la_bits").to_pylist(),
                      ca=table.column("ca_bits").to_pylist(), tile=profile["tile"], n_layers=model["n_layers"],
                      n_heads=model["n_heads"], meta=meta)


def head_vectors(n_heads: int, n_layers: int, model_heads: int, layer: int | None) -> list[int]:
    """Vector index (layer * model_heads + head) inside a document's blob for each benchmark query head."""
    if layer is None:
        return [h * n_layers * model_heads // n_heads for h in range(n_heads)]
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer={layer} is out of range for a model with {n_layers} layers")
    return [layer * model_heads + h % model_heads for h in range(n_heads)]


def cut_bits(la: bytes, ca: bytes, n_from: int, n_to: int, tile: int, n_vectors: int) -> tuple[bytes, bytes]:
    """A document's blobs (n_from tokens) -> the blobs of its first n_to tokens (see the module docstring)."""
    p, p2 = n_pages(n_from, tile), n_pages(n_to, tile)
    la_rows = torch.frombuffer(bytearray(la), dtype=torch.uint8).view(n_vectors, la_nbytes(n_from, tile))
    ca_rows = torch.frombuffer(bytearray(ca), dtype=torch.uint8).view(n_vectors, ca_nbytes(n_from, tile))
    la_cut = unpack_msb(la_rows, p * (p + 1) // 2)[:, : p2 * (p2 + 1) // 2]
    ca_cut = unpack_msb(ca_rows, p)[:, :p2]
    return pack_msb(la_cut).numpy().tobytes(), pack_msb(ca_cut).numpy().tobytes()


def doc_plan(context: int, prefix: int, query: int, stored: list[int]) -> list[tuple[int, int]]:
    """-> [(stored document, tokens used)]: stored documents in order, cycling, the last one cut to fit."""
    budget = context - prefix - query
    if budget < 1:
        raise ValueError(f"context={context} leaves no document tokens after prefix={prefix} and query={query}")
    plan, i = [], 0
    while budget > 0:
        d = i % len(stored)
        plan.append((d, min(stored[d], budget)))
        budget -= plan[-1][1]
        i += 1
    return plan


def mask_stats(layout: BatchLayout, indptr: torch.Tensor, indices: torch.Tensor, n_heads: int) -> dict:
    """Fractions of causal (head, query block, key block) tiles kept, overall and per row kind; document rows
    split into prefix / earlier-document (CA) / own-document (LA) key blocks."""
    nb = layout.n_blocks
    kind = layout.block_kind.long().cpu()
    doc = layout.block_doc.long().cpu()
    ptr = indptr.long().cpu()
    idx = indices[: int(ptr[-1])].long().cpu()
    counts = ptr[1:] - ptr[:-1]
    qb = torch.arange(n_heads * nb) % nb
    row_of = torch.repeat_interleave(qb, counts)
    first = layout.req_first_block.long().cpu()[layout.block_request.long().cpu()]
    causal = (torch.arange(nb) - first + 1).repeat(n_heads)  # causal key blocks per row

    def frac(kept, total):
        return kept / total if total else float("nan")

    out = dict(tiles=int(ptr[-1]), causal_tiles=n_heads * layout.causal_block_pairs,
               tile_fraction=frac(int(ptr[-1]), n_heads * layout.causal_block_pairs))
    for name, code in (("prefix", PREFIX), ("doc", DOC), ("query", QUERY)):
        rows = kind[qb] == code
        out[f"{name}_rows"] = dict(tiles=int(counts[rows].sum()), causal_tiles=int(causal[rows].sum()),
                                   fraction=frac(int(counts[rows].sum()), int(causal[rows].sum())))
    # Document rows by key-block class; the denominators count every causal tile of that class.
    is_doc_row = kind[row_of] == DOC
    kdoc, qdoc = doc[idx], doc[row_of]
    doc_qb = torch.nonzero(kind == DOC)[:, 0]
    n_prefix_blocks = int((kind == PREFIX).sum())
    own_causal = sum(int(n) * (int(n) + 1) // 2 for n in layout.doc_n_blocks.cpu())
    earlier = sum(int(layout.doc_first_block[d]) - n_prefix_blocks for d in doc[doc_qb].tolist())
    for name, sel, total in (
        ("prefix", kind[idx] == PREFIX, n_prefix_blocks * doc_qb.numel()),
        ("earlier_docs", (kind[idx] == DOC) & (kdoc != qdoc), earlier),
        ("own_doc", (kind[idx] == DOC) & (kdoc == qdoc), own_causal),
    ):
        out[f"doc_rows_{name}"] = frac(int((is_doc_row & sel).sum()), n_heads * total)
    return out


def real_mask(context: int, n_heads: int = 32, device: str | torch.device | None = None, *,
              layer: int | None = None, prefix: int = 128, query: int = 512, block: int = 128,
              backend: str = "auto", path: str | Path = DATA) -> RealMask:
    """Mask (b) at `context` tokens -> RealMask(layout, indptr, indices, stats) on `device` (default: CUDA if
    available, else CPU). backend: "auto" (Triton decode on CUDA, ref twin on CPU), "triton" (also on CPU
    under TRITON_INTERPRET=1) or "torch"."""
    dev = torch.empty(0, device=device or ("cuda" if torch.cuda.is_available() else "cpu")).device
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'triton' or 'torch'")
    if n_heads < 1 or prefix < 0 or query < 0:
        raise ValueError(f"need n_heads >= 1, prefix >= 0, query >= 0; got {n_heads}, {prefix}, {query}")
    bits = load_bits(path)
    n_vec = bits.n_layers * bits.n_heads
    plan = doc_plan(context, prefix, query, bits.n_tokens)
    la_blobs, ca_blobs = [], []
    for d, n in plan:
        la, ca = bits.la[d], bits.ca[d]
        if n < bits.n_tokens[d]:
            la, ca = cut_bits(la, ca, bits.n_tokens[d], n, bits.tile, n_vec)
        la_blobs.append(la)
        ca_blobs.append(ca)
    segments = ([("prefix", prefix)] if prefix else []) + [("doc", n) for _, n in plan] + (
        [("query", query)] if query else [])
    layout = build_layout([segments], block, device=dev)
    packed = pack_doc_bits(la_blobs, ca_blobs, [n for _, n in plan], tile=bits.tile, n_layers=bits.n_layers,
                           n_heads=bits.n_heads, device=dev)
    vec = torch.tensor(head_vectors(n_heads, bits.n_layers, bits.n_heads, layer), dtype=torch.int64, device=dev)
    la_ptr = packed.la_base[:, None] + vec[None, :] * packed.la_head_nbytes[:, None]  # [n_docs, n_heads]
    ca_ptr = packed.ca_base[:, None] + vec[None, :] * packed.ca_head_nbytes[:, None]
    decode = block_indices if backend == "triton" else block_indices_ref
    indptr, indices = decode(layout, packed.la_bytes, la_ptr, packed.ca_bytes, ca_ptr, bits.tile)
    indices = indices[: int(indptr[-1])]  # the Triton decode allocates the dense upper bound
    stats = mask_stats(layout, indptr, indices, n_heads)
    stats.update(context=context, n_heads=n_heads, block=block, n_blocks=layout.n_blocks, prefix=prefix,
                 query=query, doc_tokens=[n for _, n in plan], stored_docs=[d for d, _ in plan],
                 heads=[(v // bits.n_heads, v % bits.n_heads) for v in vec.tolist()],
                 layer="spread" if layer is None else layer, backend=backend, tile=bits.tile,
                 model=bits.meta["model"]["name"], fingerprint=bits.meta["model"]["fingerprint"])
    return RealMask(layout, indptr, indices, stats)


def dense_mask(rm: RealMask, n_heads: int = 32) -> torch.Tensor:
    """The CSR of `rm` as a block mask bool [n_heads, NB, NB] (what FlexAttention and `csr` take)."""
    nb = rm.layout.n_blocks
    counts = (rm.indptr[1:] - rm.indptr[:-1]).long()
    rows_of = torch.repeat_interleave(torch.arange(n_heads * nb, device=rm.indptr.device), counts)
    mask = torch.zeros(n_heads * nb, nb, dtype=torch.bool, device=rm.indptr.device)
    mask[rows_of, rm.indices.long()] = True
    return mask.view(n_heads, nb, nb)


if __name__ == "__main__":  # print the statistics: python bench/masks.py [context ...]
    import sys

    for ctx in [int(x) for x in sys.argv[1:]] or [16384, 32768, 65536]:
        s = real_mask(ctx).stats
        print(json.dumps({k: v for k, v in s.items() if k not in ("heads", "doc_tokens", "stored_docs")}))
