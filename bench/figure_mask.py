"""The README's figure: which attention blocks SIFT computes for one RAG prompt -> docs/mask.png.

    python bench/figure_mask.py [--context 8192] [--layer 14] [--head 3] [--out docs/mask.png]   (CPU, seconds)

The prompt is mask (b) of the attention benchmark (bench/masks.py): a 128-token prefix, 2048-token Wikipedia
documents with real SIFT bits of SmolLM2-135M-Instruct (tile 64) and a 512-token query, decoded to 128-token
kernel blocks by the runtime's own decode (its ref twin). One (layer, head) of the model is drawn: each cell is
a (query block, key block) pair, coloured by what it is and whether it is computed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from masks import dense_mask, real_mask
from sift.kernels.layout import DOC, PREFIX, QUERY

ROOT = Path(__file__).resolve().parent.parent


def classes(context: int, layer: int, head: int) -> tuple[torch.Tensor, dict]:
    """-> (int [NB, NB] cell classes, stats): 0 above the diagonal, 1 skipped, 2 computed in the prefix or query
    rows (always dense), 3 a document's own tiles kept (LA), 4 an earlier document's pages kept (CA), 5 the
    prefix read by a document."""
    rm = real_mask(context, n_heads=9, device="cpu", layer=layer, backend="torch")   # the layer's 9 heads
    kept = dense_mask(rm, 9)[head]
    lay = rm.layout
    kind, doc = lay.block_kind.long(), lay.block_doc.long()
    nb = lay.n_blocks
    causal = torch.ones(nb, nb, dtype=torch.bool).tril()
    out = torch.where(causal, 1, 0)
    dense_row = (kind == PREFIX) | (kind == QUERY)
    doc_row = kind == DOC
    out[dense_row[:, None] & kept] = 2
    own = doc_row[:, None] & (doc[:, None] == doc[None, :])
    earlier = doc_row[:, None] & (kind[None, :] == DOC) & (doc[None, :] < doc[:, None])
    out[own & kept] = 3
    out[earlier & kept] = 4
    out[doc_row[:, None] & (kind[None, :] == PREFIX) & kept] = 5
    return out, dict(tiles=int(kept.sum()), causal=int(causal.sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens (prefix + documents + query)")
    ap.add_argument("--layer", type=int, default=14, help="SmolLM2 layer, 0-29")
    ap.add_argument("--head", type=int, default=3, help="query head of the layer, 0-8")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mask.png")
    args = ap.parse_args()
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    cells, stats = classes(args.context, args.layer, args.head)
    colours = ["#ffffff", "#e8e8e8", "#9aa7b8", "#1f77b4", "#d62728", "#7f7f7f"]
    labels = [None, "skipped", "prefix and query rows (dense)", "a document's own tiles kept (LA)",
              "earlier documents' pages kept (CA)", "the prefix, read by every document"]
    fig = Figure(figsize=(7.2, 5.4))
    ax = fig.subplots()
    ax.imshow(cells.numpy(), cmap=ListedColormap(colours), vmin=0, vmax=5, interpolation="nearest")
    layer, head = args.layer, args.head
    ax.set(xlabel="key block (128 tokens)", ylabel="query block (128 tokens)",
           title=f"One RAG prompt of {args.context // 1024}K tokens, SmolLM2 layer {layer} head {head}: "
                 f"{stats['tiles'] / stats['causal']:.0%} of blocks computed")
    ax.title.set_fontsize(9)
    ax.legend(handles=[Patch(color=c, label=t) for c, t in zip(colours, labels) if t], fontsize=7, loc="upper right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {stats}")


if __name__ == "__main__":
    main()
