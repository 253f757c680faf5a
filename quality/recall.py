"""The SIFT paper's recall, measured its way: how much of the attention a multi-document prompt really pays
falls in the tiles and pages the index keeps.

The bits come from each document profiled on its own (SPEC section 2); a RAG prompt places the document after a
system prompt and other documents. This module runs the model on the whole unsegmented prompt with an exact
attention function of its own (fp32 softmax over each row's causal keys, computed one query block at a time,
so no L x L matrix is ever held) and, per (layer, query head), counts against the documents' bits:

    LA recall     own-document cells (query and key in the same document, causal) with A >= alpha: the share
                  that falls in kept LA tiles (document-local tiles of the index's tile size)
    CA recall     cross-document cells (query in a document, key in an earlier one) with A >= beta: the share
                  that falls in kept CA pages of the key's document
    LA sparsity   the share of a document's lower-triangle tiles not kept
    CA sparsity   the share of (query tile of a document, page of an earlier document) pairs not kept, i.e. the
                  cross-document work SIFT skips
    mass kept     the share of the attention mass of document rows on cells the sparse pattern computes (the
                  prefix, kept pages of earlier documents, kept tiles of the row's own document)
    CA mass lost  per layer, the share of document rows' attention mass on pages of earlier documents the CA
                  bits drop (what `sift-calibrate --guard-ca` ranks layers by), and the same per (layer, head)
                  (`heads_ca_mass_lost`, what `--guard-by head` ranks heads by)

alpha and beta are the index's own thresholds. Prefix and query rows are dense in SIFT and are not counted.
Counts are summed over heads, documents and prompts, per layer; "total" sums the layers.

By default the bits are counted as profiled, at the index's tile (the paper's measure). With a kernel block
larger than the tile (`measure(..., block=128)`, what a GPU engine runs), the engine computes a whole
(query block, key block) as soon as one tile or page in it is kept: `coarsen` turns the bits into that pattern,
so that recall and the CA mass lost count what the engine actually drops.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..kernels.bits import tril_to_square, unpack_msb
from ..runtime.engine import Request

ATTN_NAME = "sift_recall"
# The SIFT paper's figures (Llama-3-8B, LongBench), shown beside the measured ones.
PAPER = {"la_recall": 0.939, "la_sparsity": 0.727, "ca_recall": 0.801, "ca_sparsity": 0.942}
ROW_BLOCK = 256  # query rows per block (a multiple of every tile size)


@dataclass(frozen=True)
class DocMasks:
    """One document's bits, decoded. la: [layers, Hq, P, P] bool (upper triangle False); ca: [layers, Hq, P] bool."""

    la: torch.Tensor
    ca: torch.Tensor


@dataclass
class RecallCounts:
    """Per-layer sums (float64 [layers]) over heads, documents and prompts."""

    la_high: np.ndarray
    la_high_kept: np.ndarray
    ca_high: np.ndarray
    ca_high_kept: np.ndarray
    la_tiles: np.ndarray
    la_tiles_kept: np.ndarray
    ca_pairs: np.ndarray
    ca_pairs_kept: np.ndarray
    mass: np.ndarray
    mass_kept: np.ndarray
    ca_mass: np.ndarray
    ca_mass_kept: np.ndarray
    head_ca_mass: np.ndarray       # float64 [layers, Hq]: the same two, per query head
    head_ca_mass_kept: np.ndarray
    prompts: int = field(default=0)

    @classmethod
    def zeros(cls, n_layers: int, n_heads: int = 1) -> "RecallCounts":
        return cls(*(np.zeros((n_layers, n_heads) if f.name.startswith("head_") else n_layers)
                     for f in fields(cls) if f.name != "prompts"))

    def add(self, other: "RecallCounts") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def summary(self) -> dict:
        """-> {"layers": [{"layer", metrics...}], "total": {metrics...}, "prompts"}; a ratio without cells is None."""
        def ratios(s: slice) -> dict:
            def share(kept, total, complement=False):
                t = float(total[s].sum())
                if t == 0:
                    return None
                r = float(kept[s].sum()) / t
                return 1.0 - r if complement else r
            return dict(la_recall=share(self.la_high_kept, self.la_high),
                        ca_recall=share(self.ca_high_kept, self.ca_high),
                        la_sparsity=share(self.la_tiles_kept, self.la_tiles, True),
                        ca_sparsity=share(self.ca_pairs_kept, self.ca_pairs, True),
                        mass_kept=share(self.mass_kept, self.mass),
                        ca_mass_lost=share(self.ca_mass - self.ca_mass_kept, self.mass),
                        la_high_cells=int(self.la_high[s].sum()), ca_high_cells=int(self.ca_high[s].sum()))
        n, n_heads = self.head_ca_mass.shape
        # Every head sees the same document rows, so a head's mass is its layer's over the heads.
        per_head = self.mass[:, None] / n_heads
        with np.errstate(invalid="ignore", divide="ignore"):
            lost = np.where(per_head > 0, (self.head_ca_mass - self.head_ca_mass_kept) / per_head, np.nan)
        return dict(prompts=self.prompts, total=ratios(slice(None)),
                    layers=[dict(layer=i, **ratios(slice(i, i + 1))) for i in range(n)],
                    heads_ca_mass_lost=[[None if np.isnan(x) else float(x) for x in row] for row in lost])


# ------------------------------------------------------------------------------------- one prompt's pass


def row_blocks(spans: list[tuple[str, int, int]]):
    """(r0, r1, document ordinal or None) of each block of query rows the exact attention computes: blocks lie
    inside one segment, and a document's start at whole tiles of the document."""
    docs = [(s, e) for kind, s, e in spans if kind == "doc"]
    for kind, s, e in spans:
        for r0 in range(s, e, ROW_BLOCK):
            yield r0, min(e, r0 + ROW_BLOCK), (docs.index((s, e)) if kind == "doc" else None)


def tile_sums(x: torch.Tensor, row_tiles: int, key_tiles: int, t: int) -> torch.Tensor:
    """x: [Hq, row_tiles * t, key_tiles * t] -> [Hq, row_tiles, key_tiles] float64 sums per tile."""
    rows_summed = x.reshape(x.shape[0], row_tiles, t, key_tiles * t).sum(dim=2)
    return rows_summed.reshape(x.shape[0], row_tiles, key_tiles, t).sum(dim=-1, dtype=torch.float64)


class _Observer:
    """Per-forward state: the prompt's segment bounds and masks; accumulates counts as blocks of rows go by."""

    def __init__(self, spans: list[tuple[str, int, int]], masks: list[DocMasks], tile: int, alpha: float,
                 beta: float, n_layers: int, device: torch.device):
        self.spans, self.tile, self.n_layers = spans, tile, n_layers
        self.docs = [(s, e) for kind, s, e in spans if kind == "doc"]
        self.masks = masks                   # on the CPU, for the counts of `count_tiles`
        self.on_device = [DocMasks(la=m.la.to(device), ca=m.ca.to(device)) for m in masks]  # what `observe` reads
        self.n_prefix = next((e for kind, s, e in spans if kind == "prefix"), 0)
        self.alpha = torch.tensor(alpha, dtype=torch.float32)
        self.beta = torch.tensor(beta, dtype=torch.float32)
        self.counts = RecallCounts.zeros(n_layers, masks[0].ca.shape[1] if masks else 1)

    def row_blocks(self):
        return row_blocks(self.spans)

    def observe(self, layer: int, m: int, r0: int, r1: int, a: torch.Tensor) -> None:
        """a: [Hq, r1 - r0, r1] fp32 probabilities of rows r0..r1 (all inside document m) over keys 0..r1.
        Masked (non-causal) cells are exactly 0 and are never counted (alpha and beta are > 0 in practice)."""
        c, t = self.counts, self.tile
        s_m, _ = self.docs[m]
        hq, rows, _ = a.shape
        l0, l1 = r0 - s_m, r1 - s_m                            # document-local rows; keys 0..l1
        row_tiles, key_tiles = -(-rows // t), -(-l1 // t)
        own = a[:, :, s_m:r1]
        if l1 % t:  # only a document's last block is not whole tiles (rows and keys end together)
            own = torch.nn.functional.pad(own, (0, key_tiles * t - l1, 0, row_tiles * t - rows))
        la = self.on_device[m].la[layer][:, l0 // t:l0 // t + row_tiles, :key_tiles]
        high = tile_sums((own >= self.alpha).to(torch.float32), row_tiles, key_tiles, t)
        mass = tile_sums(own, row_tiles, key_tiles, t)
        c.la_high[layer] += float(high.sum())
        c.la_high_kept[layer] += float(high[la].sum())
        c.mass[layer] += hq * rows
        c.mass_kept[layer] += float(mass[la].sum()) + float(a[:, :, :self.n_prefix].sum(dtype=torch.float64))
        if m == 0:
            return
        s_0 = self.docs[0][0]
        cross = a[:, :, s_0:s_m]                              # keys of every earlier document
        hits_key = (cross >= self.beta).sum(dim=1, dtype=torch.float64)  # [Hq, keys]
        mass_key = cross.sum(dim=1, dtype=torch.float64)
        for i, (s_i, e_i) in enumerate(self.docs[:m]):
            p_i = -(-(e_i - s_i) // t)
            pad = (0, p_i * t - (e_i - s_i))
            hits = torch.nn.functional.pad(hits_key[:, s_i - s_0:e_i - s_0], pad).reshape(hq, p_i, t).sum(-1)
            mass_page = torch.nn.functional.pad(mass_key[:, s_i - s_0:e_i - s_0], pad).reshape(hq, p_i, t).sum(-1)
            ca = self.on_device[i].ca[layer]
            head_mass = mass_page.sum(-1).cpu().numpy()                       # [Hq]
            head_kept = (mass_page * ca).sum(-1).cpu().numpy()
            kept = float(head_kept.sum())
            c.ca_high[layer] += float(hits.sum())
            c.ca_high_kept[layer] += float(hits[ca].sum())
            c.ca_mass[layer] += float(head_mass.sum())
            c.ca_mass_kept[layer] += kept
            c.head_ca_mass[layer] += head_mass
            c.head_ca_mass_kept[layer] += head_kept
            c.mass_kept[layer] += kept

    def count_tiles(self) -> None:
        """The data-independent counts: tiles and cross-document pairs, all and kept."""
        c, t = self.counts, self.tile
        pages = [-(-(e - s) // t) for s, e in self.docs]
        for m, masks in enumerate(self.masks):
            p = pages[m]
            c.la_tiles += masks.la.shape[1] * p * (p + 1) / 2
            c.la_tiles_kept += masks.la.sum(dim=(1, 2, 3)).double().numpy()
            later = sum(pages[m + 1:])  # query tiles of the documents after this one
            c.ca_pairs += masks.ca.shape[1] * p * later
            c.ca_pairs_kept += later * masks.ca.sum(dim=(1, 2)).double().numpy()


def _recall_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sift_recall: _Observer | None = None, **kwargs):
    """AttentionInterface function: exact causal attention, one block of rows at a time, with the observer fed
    each document block's probabilities. query [1, Hq, L, D], key / value [1, Hkv, L, D] -> ([1, L, Hq, D], None)."""
    if sift_recall is None:
        raise RuntimeError("the sift_recall attention runs only inside measure_prompt")
    q, k, v = query[0], key[0], value[0]
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    softcap = getattr(module.config, "attn_logit_softcapping", None)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=v.dtype, device=v.device)
    positions = torch.arange(q.shape[1], device=q.device)
    for r0, r1, m in sift_recall.row_blocks():
        s = torch.matmul(q[:, r0:r1], k[:, :r1].transpose(-1, -2)) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        causal = positions[None, :r1] <= positions[r0:r1, None]
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32)
        out[:, r0:r1] = torch.matmul(a.to(v.dtype), v[:, :r1])
        if m is not None:
            sift_recall.observe(module.layer_idx, m, r0, r1, a)
    return out.transpose(0, 1).unsqueeze(0), None


@torch.inference_mode()
def measure_prompt(model, segments: list[tuple[str, list[int]]], masks: list[DocMasks], *, tile: int,
                   alpha: float, beta: float) -> RecallCounts:
    """One prompt's counts. segments: (kind, token ids) in prompt order as `SiftEngine.tokenize` gives them;
    masks: the bits of its documents, in order (on the CPU). Runs on the model's device."""
    n_layers = model.config.num_hidden_layers
    observer = _Observer(spans_of(segments), masks, tile, alpha, beta, n_layers, model.device)
    observer.count_tiles()
    run_exact(model, segments, observer)
    observer.counts.prompts = 1
    return observer.counts


def spans_of(segments: list[tuple[str, list[int]]]) -> list[tuple[str, int, int]]:
    """(kind, token ids) in prompt order -> (kind, start, end) of each segment in the unsegmented prompt."""
    spans, pos = [], 0
    for kind, ids in segments:
        spans.append((kind, pos, pos + len(ids)))
        pos += len(ids)
    return spans


@torch.inference_mode()
def run_exact(model, segments: list[tuple[str, list[int]]], observer) -> None:
    """One forward of `model` over the unsegmented prompt with the exact attention of this module, feeding
    `observer` (an object with `row_blocks()` and `observe(layer, m, r0, r1, a)`, as `_Observer`) each block of
    document rows' probabilities."""
    from transformers import AttentionInterface

    ids = torch.tensor([[t for _, seg in segments for t in seg]], device=model.device)
    AttentionInterface.register(ATTN_NAME, _recall_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        model.base_model(input_ids=ids, use_cache=False, sift_recall=observer)
    finally:
        model.set_attn_implementation(previous)


# -------------------------------------------------------------------------------------- over an index


def coarsen(masks: DocMasks, r: int) -> DocMasks:
    """The tiles and pages a kernel block of `r` tiles computes (blocks start at the document's first tile, as
    the layout pads documents to whole blocks): a tile (i, j) is computed iff some kept tile of its block pair
    (i // r, j // r) is, a page iff some kept page of its key block is. Same shapes as `masks`."""
    if r == 1:
        return masks
    la, ca = masks.la, masks.ca
    p = ca.shape[-1]
    nb = -(-p // r)
    pad = nb * r - p
    la_blocks = torch.nn.functional.pad(la, (0, pad, 0, pad)).reshape(*la.shape[:2], nb, r, nb, r).any(dim=(3, 5))
    ca_blocks = torch.nn.functional.pad(ca, (0, pad)).reshape(*ca.shape[:2], nb, r).any(dim=-1)
    la = la_blocks.repeat_interleave(r, dim=2).repeat_interleave(r, dim=3)[..., :p, :p]
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    return DocMasks(la=la & causal, ca=ca_blocks.repeat_interleave(r, dim=-1)[..., :p])


def doc_masks(index, docs: list[tuple[str, int]], block: int | None = None) -> list[DocMasks]:
    """docs: (doc_id, n_tokens) -> their bits from the index, decoded (on the CPU); with `block` (a multiple
    of the index tile), as a kernel of that block computes them (`coarsen`)."""
    bits = index.fetch(docs)
    layers, heads = bits.n_layers, bits.n_heads
    out = []
    for i, (_, n) in enumerate(docs):
        p = -(-n // index.tile)
        la_nb, ca_nb = int(bits.la_head_nbytes[i]), int(bits.ca_head_nbytes[i])
        la0, ca0 = int(bits.la_base[i]), int(bits.ca_base[i])
        la = bits.la_bytes[la0:la0 + layers * heads * la_nb].view(layers, heads, la_nb).cpu()
        ca = bits.ca_bytes[ca0:ca0 + layers * heads * ca_nb].view(layers, heads, ca_nb).cpu()
        masks = DocMasks(la=tril_to_square(unpack_msb(la, p * (p + 1) // 2), p), ca=unpack_msb(ca, p))
        out.append(coarsen(masks, (block or index.tile) // index.tile))
    return out


def measure(engine, requests: list[Request], echo=lambda msg: None, block: int | None = None) -> dict:
    """The recall section of an eval: the engine's index and model over the requests' multi-document prompts
    (every document must be in the index and fresh: the eval checks that first). block: count the bits as a
    kernel of this block computes them (None: as profiled, at the index tile). -> summary with the
    thresholds, the block and the paper's figures."""
    index = engine.index
    block = block or index.tile
    if block % index.tile:
        raise ValueError(f"block {block} is not a multiple of the index tile {index.tile}")
    profile = index.manifest.profile
    alpha, beta = float(profile["alpha"]), float(profile["beta"])
    counts = RecallCounts.zeros(engine.model.config.num_hidden_layers, engine.model.config.num_attention_heads)
    for k, request in enumerate(requests, 1):
        segments = engine.tokenize(request)
        doc_ids = [ids for kind, ids in segments if kind == "doc"]
        docs = [(doc_id, len(ids)) for (doc_id, _), ids in zip(request.docs, doc_ids)]
        counts.add(measure_prompt(engine.model, segments, doc_masks(index, docs, block), tile=index.tile,
                                  alpha=alpha, beta=beta))
        echo(f"recall: {k}/{len(requests)} prompts")
    return dict(alpha=alpha, beta=beta, gamma=profile.get("gamma"), tile=index.tile, block=block, paper=PAPER,
                **counts.summary())
