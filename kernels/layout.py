"""Physical layout of a batch of RAG requests (SPEC sections 4 and 5): segments padded to whole kernel blocks.

The requests of a batch are packed one after another into `N = NB * block` physical slots. Every segment
(prefix, each document, query) is padded to whole blocks, so a block belongs to exactly one segment; inside a
block the real tokens come first and the padding after. Keys and queries are stored position-free, rotated at
**segment-local** positions (each segment starts at local position 0), and each block records the logical
position of its segment's first token (`block_offset`), so that

    logical position of slot s of block b = block_offset[b] + block_local0[b] + s      (s < block_valid[b])

Logical positions are consecutive over the real tokens of a request, exactly as in the unsegmented prompt:
padding never changes one.

This is host-side metadata, built once per batch with torch (vectorised over tokens and blocks; the Python
loop is over segments only) and then moved to the device the kernels run on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

PREFIX, DOC, QUERY = 0, 1, 2
KIND_CODES = {"prefix": PREFIX, "doc": DOC, "query": QUERY}


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """Block, segment, document and token tables of one batch. All tensors live on `device`.

    Segments are numbered request-major in prompt order (a request's segments as given, empty prefix / query
    included with 0 blocks); documents are numbered the same way over document segments only (the "document
    ordinal" that indexes the bit pointers of `block_indices`). Kinds are coded PREFIX=0, DOC=1, QUERY=2.
    """

    block: int
    n_blocks: int  # NB
    n_requests: int
    n_segments: int
    n_docs: int
    n_tokens: int  # real tokens of the whole batch
    request_blocks: tuple[tuple[int, int], ...]  # per request (first block, number of blocks), Python ints
    causal_block_pairs: int  # sum over requests of nb * (nb + 1) / 2: the dense causal block count per head
    device: torch.device

    # per block: int32 [NB]
    block_valid: torch.Tensor  # real tokens in the block (>= 1: a segment takes ceil(n / block) blocks)
    block_offset: torch.Tensor  # logical position of the first token of the block's segment
    block_local0: torch.Tensor  # segment-local position of the block's first slot
    block_request: torch.Tensor
    block_segment: torch.Tensor
    block_kind: torch.Tensor
    block_doc: torch.Tensor  # document ordinal, -1 for prefix / query blocks

    # per segment: int32 [n_segments]
    seg_request: torch.Tensor
    seg_kind: torch.Tensor
    seg_first_block: torch.Tensor  # for an empty segment: the block where it would start
    seg_n_blocks: torch.Tensor
    seg_n_tokens: torch.Tensor
    seg_offset: torch.Tensor  # logical position of the segment's first token

    # per document: int32 [n_docs]
    doc_segment: torch.Tensor
    doc_request: torch.Tensor
    doc_first_block: torch.Tensor
    doc_n_blocks: torch.Tensor
    doc_n_tokens: torch.Tensor

    # per request: int32 [B]
    req_first_block: torch.Tensor
    req_n_blocks: torch.Tensor
    req_n_tokens: torch.Tensor
    req_first_doc: torch.Tensor
    req_n_docs: torch.Tensor
    req_first_token: torch.Tensor  # index of the request's first token in the packed (unpadded) token order

    # per real token, request-major in prompt order: int64 [n_tokens]
    token_phys: torch.Tensor  # physical slot
    token_logical_pos: torch.Tensor  # position in the unsegmented prompt of its request
    token_local_pos: torch.Tensor  # position inside its segment (the RoPE position keys are stored at)

    @property
    def n_slots(self) -> int:
        return self.n_blocks * self.block

    @property
    def max_request_blocks(self) -> int:
        return max((nb for _, nb in self.request_blocks), default=0)

    def scatter(self, x: torch.Tensor, dim: int = 0, fill: float = 0.0) -> torch.Tensor:
        """Packed real tokens -> padded physical slots. x: [..., n_tokens (at dim), ...] -> [..., NB * block, ...],
        padding slots set to `fill`."""
        dim = dim % x.dim()
        if x.shape[dim] != self.n_tokens:
            raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim}; the layout has {self.n_tokens}")
        shape = list(x.shape)
        shape[dim] = self.n_slots
        out = torch.full(shape, fill, dtype=x.dtype, device=x.device)
        return out.index_copy_(dim, self.token_phys.to(x.device), x)

    def gather(self, x_phys: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Padded physical slots -> packed real tokens (inverse of `scatter`). [..., NB * block, ...] ->
        [..., n_tokens, ...]."""
        dim = dim % x_phys.dim()
        if x_phys.shape[dim] != self.n_slots:
            raise ValueError(f"x_phys has {x_phys.shape[dim]} slots along dim {dim}; the layout has {self.n_slots}")
        return x_phys.index_select(dim, self.token_phys.to(x_phys.device))

    def to(self, device: torch.device | str) -> "BatchLayout":
        device = _resolve(device)
        fields = {
            name: (value.to(device) if isinstance(value, torch.Tensor) else value)
            for name, value in self.__dict__.items()
        }
        fields["device"] = device
        return BatchLayout(**fields)


def _resolve(device: torch.device | str) -> torch.device:
    # "cuda" -> "cuda:0": the index the tensors will report, so device comparisons hold.
    return torch.empty(0, device=device).device


def _validate(requests: Sequence[Sequence[tuple[str, int]]], block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two")
    if len(requests) == 0:
        raise ValueError("the batch has no requests; pass at least one")
    for r, segments in enumerate(requests):
        kinds = []
        for s, seg in enumerate(segments):
            if len(seg) != 2:
                raise ValueError(f"request {r} segment {s} is {seg!r}; expected (kind, n_tokens)")
            kind, n = seg
            if kind not in KIND_CODES:
                raise ValueError(f"request {r} segment {s} has kind {kind!r}; expected one of {tuple(KIND_CODES)}")
            if int(n) != n or n < 0:
                raise ValueError(f"request {r} segment {s} has n_tokens={n!r}; expected an int >= 0")
            if kind == "doc" and n < 1:
                raise ValueError(f"request {r} segment {s}: a document needs at least 1 token, got {n}")
            kinds.append(kind)
        if kinds.count("prefix") > 1 or ("prefix" in kinds and kinds[0] != "prefix"):
            raise ValueError(f"request {r}: at most one prefix, and it must come first; got kinds {kinds}")
        if kinds.count("query") > 1 or ("query" in kinds and kinds[-1] != "query"):
            raise ValueError(f"request {r}: at most one query, and it must come last; got kinds {kinds}")
        if sum(n for _, n in segments) == 0:
            raise ValueError(f"request {r} has no tokens")


def build_layout(
    requests: Sequence[Sequence[tuple[str, int]]], block: int, device: torch.device | str = "cpu"
) -> BatchLayout:
    """requests: per request, its segments `(kind, n_tokens)` in prompt order, kind in {"prefix", "doc",
    "query"}: an optional prefix first, documents (>= 1 token each), an optional query last. A segment of
    n tokens takes ceil(n / block) blocks (so an empty prefix or query takes none)."""
    _validate(requests, block)
    seg_request, seg_kind, seg_n_tokens = [], [], []
    for r, segments in enumerate(requests):
        for kind, n in segments:
            seg_request.append(r)
            seg_kind.append(KIND_CODES[kind])
            seg_n_tokens.append(int(n))

    i64 = dict(dtype=torch.int64)
    seg_request_t = torch.tensor(seg_request, **i64)
    seg_kind_t = torch.tensor(seg_kind, **i64)
    seg_n_tokens_t = torch.tensor(seg_n_tokens, **i64)
    n_req = len(requests)
    n_seg = len(seg_request)

    seg_n_blocks = (seg_n_tokens_t + block - 1) // block
    seg_first_block = torch.cumsum(seg_n_blocks, 0) - seg_n_blocks
    # Logical offsets restart at 0 for every request: exclusive cumsum minus the request's first value.
    seg_excl = torch.cumsum(seg_n_tokens_t, 0) - seg_n_tokens_t
    req_first_seg = torch.searchsorted(seg_request_t, torch.arange(n_req), right=False)
    seg_offset = seg_excl - seg_excl[req_first_seg][seg_request_t]

    nb = int(seg_n_blocks.sum())
    seg_ids = torch.arange(n_seg)
    block_segment = torch.repeat_interleave(seg_ids, seg_n_blocks, output_size=nb)
    block_in_seg = torch.arange(nb) - seg_first_block[block_segment]
    block_local0 = block_in_seg * block
    block_valid = torch.clamp(seg_n_tokens_t[block_segment] - block_local0, max=block)
    block_request = seg_request_t[block_segment]
    block_kind = seg_kind_t[block_segment]
    block_offset = seg_offset[block_segment]

    is_doc = seg_kind_t == DOC
    doc_segment = seg_ids[is_doc]
    seg_doc = torch.full((n_seg,), -1, **i64)
    seg_doc[doc_segment] = torch.arange(len(doc_segment))
    block_doc = seg_doc[block_segment]

    req_n_blocks = torch.zeros(n_req, **i64).index_add_(0, seg_request_t, seg_n_blocks)
    req_first_block = torch.cumsum(req_n_blocks, 0) - req_n_blocks
    req_n_tokens = torch.zeros(n_req, **i64).index_add_(0, seg_request_t, seg_n_tokens_t)
    req_first_token = torch.cumsum(req_n_tokens, 0) - req_n_tokens
    req_n_docs = torch.zeros(n_req, **i64).index_add_(0, seg_request_t, is_doc.long())
    req_first_doc = torch.cumsum(req_n_docs, 0) - req_n_docs

    n_tok = int(seg_n_tokens_t.sum())
    token_segment = torch.repeat_interleave(seg_ids, seg_n_tokens_t, output_size=n_tok)
    token_local = torch.arange(n_tok) - (torch.cumsum(seg_n_tokens_t, 0) - seg_n_tokens_t)[token_segment]
    token_phys = seg_first_block[token_segment] * block + token_local
    token_logical = seg_offset[token_segment] + token_local

    dev = _resolve(device)

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=torch.int32)

    req_nb = req_n_blocks.tolist()
    return BatchLayout(
        block=block,
        n_blocks=nb,
        n_requests=n_req,
        n_segments=n_seg,
        n_docs=len(doc_segment),
        n_tokens=n_tok,
        request_blocks=tuple(zip(req_first_block.tolist(), req_nb)),
        causal_block_pairs=sum(n * (n + 1) // 2 for n in req_nb),
        device=dev,
        block_valid=i32(block_valid),
        block_offset=i32(block_offset),
        block_local0=i32(block_local0),
        block_request=i32(block_request),
        block_segment=i32(block_segment),
        block_kind=i32(block_kind),
        block_doc=i32(block_doc),
        seg_request=i32(seg_request_t),
        seg_kind=i32(seg_kind_t),
        seg_first_block=i32(seg_first_block),
        seg_n_blocks=i32(seg_n_blocks),
        seg_n_tokens=i32(seg_n_tokens_t),
        seg_offset=i32(seg_offset),
        doc_segment=i32(doc_segment),
        doc_request=i32(seg_request_t[doc_segment]),
        doc_first_block=i32(seg_first_block[doc_segment]),
        doc_n_blocks=i32(seg_n_blocks[doc_segment]),
        doc_n_tokens=i32(seg_n_tokens_t[doc_segment]),
        req_first_block=i32(req_first_block),
        req_n_blocks=i32(req_n_blocks),
        req_n_tokens=i32(req_n_tokens),
        req_first_doc=i32(req_first_doc),
        req_n_docs=i32(req_n_docs),
        req_first_token=i32(req_first_token),
        token_phys=token_phys.to(dev),
        token_logical_pos=token_logical.to(dev),
        token_local_pos=token_local.to(dev),
    )


def gather_blocks(x: torch.Tensor, pages: torch.Tensor, block: int) -> torch.Tensor:
    """x [H, P * block, D] (any strides: a pool of pages) -> [H, NB * block, D], block b = page pages[b]
    (int [NB]): a pool's pages in logical order, as the paged kernels read them."""
    return x.unflatten(1, (-1, block)).index_select(1, pages.to(x.device).long()).flatten(1, 2)
