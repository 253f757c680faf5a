"""Pictures of an index and of an eval: what `sift-inspect --plot` and `sift-eval` draw.

    index_density   decode every document's bit vectors into per-(layer, head) densities and per-document
                    fractions -> `IndexDensity` (numbers only: `sift-inspect --json` prints them too)
    index_figures   OUT_DIR/head_density.png        LA and CA density per (layer, head), mean over documents
                    OUT_DIR/doc_fractions.png       the distribution of per-document LA tile / CA page fractions
                    OUT_DIR/density_vs_length.png   the same fractions against document length
    mode_summary    sift-eval's per-mode means with their intervals
    recall_by_layer sift-eval --recall: LA / CA recall and sparsity per layer beside the paper's figures
    pareto_front    sift-calibrate: agreement with dense against tiles computed per setting, and the front

Figures are drawn on `matplotlib.figure.Figure` (no pyplot), which renders PNGs with Agg and keeps no global
backend state, so a server process can call this. The module imports nothing of the builder or the runtime
(only `sift.format` and `sift.errors`): both of their CLIs use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from sift.errors import SiftError
from sift.format import ca_nbytes, la_nbytes, n_pages

FIGURES = ("head_density.png", "doc_fractions.png", "density_vs_length.png")


# ------------------------------------------------------------------------------------------ the numbers


@dataclass(frozen=True)
class IndexDensity:
    """The share of bits set in an index's vectors, per (layer, head) and per document."""

    la_heads: np.ndarray    # [layers, heads] mean over documents of each head's fraction of LA tiles kept
    ca_heads: np.ndarray    # [layers, heads] the same for CA pages
    doc_la: np.ndarray      # [docs] fraction of the document's LA tiles kept, all (layer, head) together
    doc_ca: np.ndarray      # [docs] fraction of its CA pages kept
    n_tokens: np.ndarray    # [docs]
    tile_fraction: float    # LA tiles kept over all LA tiles of the index (what prefill computes of dense)
    page_fraction: float    # CA pages kept over all CA pages of the index


# The two kinds of vector: their bytes per (layer, head) and their bits, from the token and page counts.
_SIZES = {"la_bits": (la_nbytes, lambda p: p * (p + 1) // 2), "ca_bits": (ca_nbytes, lambda p: p)}


def _fractions(table: pa.Table, column: str, pages: np.ndarray, tile: int, vectors: int) -> np.ndarray:
    """-> [docs, vectors]: the share of bits set in each (layer, head) vector of `column` (MSB-first, SPEC
    section 2; padding bits not counted). Documents with the same page count have vectors of the same size,
    so each such group is decoded as one array."""
    nbytes_of, bits_of = _SIZES[column]
    n_tokens, blobs = table["n_tokens"].to_pylist(), table[column].to_pylist()
    out = np.zeros((len(blobs), vectors))
    for p in np.unique(pages):
        rows = np.flatnonzero(pages == p)
        nbytes, n_bits = nbytes_of(n_tokens[rows[0]], tile), int(bits_of(p))
        for i in rows:
            if len(blobs[i]) != vectors * nbytes:
                doc = table["doc_id"][i].as_py() if "doc_id" in table.column_names else f"row {i}"
                raise SiftError(f"document {doc}: {column} holds {len(blobs[i])} bytes, expected {vectors * nbytes} "
                                f"for {n_tokens[i]} tokens at tile {tile}: the index is corrupt; rebuild it")
        packed = np.frombuffer(b"".join(blobs[i] for i in rows), dtype=np.uint8).reshape(len(rows), vectors, nbytes)
        out[rows] = np.unpackbits(packed, axis=2, count=n_bits).sum(axis=2) / n_bits
    return out


def _weighted(doc_fraction: np.ndarray, weight: np.ndarray) -> float:
    """The index's fraction: kept over all, i.e. the per-document fractions weighted by their sizes."""
    return float((doc_fraction * weight).sum() / weight.sum()) if weight.sum() else 0.0


def index_density(table: pa.Table, *, tile: int, n_layers: int, n_heads: int) -> IndexDensity:
    """table: rows with n_tokens, la_bits, ca_bits (DOCS_SCHEMA) -> the densities of their bits."""
    n_tokens = np.asarray(table["n_tokens"].to_pylist(), dtype=np.int64)
    pages = np.array([n_pages(int(n), tile) for n in n_tokens], dtype=np.int64)
    la = _fractions(table, "la_bits", pages, tile, n_layers * n_heads)   # [docs, layers * heads]
    ca = _fractions(table, "ca_bits", pages, tile, n_layers * n_heads)
    # Within one document every (layer, head) vector has the same size: its fraction is the plain mean.
    doc_la, doc_ca = la.mean(axis=1), ca.mean(axis=1)
    return IndexDensity(la_heads=_mean_over_docs(la, n_layers, n_heads),
                        ca_heads=_mean_over_docs(ca, n_layers, n_heads), doc_la=doc_la, doc_ca=doc_ca,
                        n_tokens=n_tokens, tile_fraction=_weighted(doc_la, pages * (pages + 1) // 2),
                        page_fraction=_weighted(doc_ca, pages))


def _mean_over_docs(frac: np.ndarray, n_layers: int, n_heads: int) -> np.ndarray:
    """frac: [docs, layers * heads], vectors in (layer, head) order as stored -> [layers, heads]."""
    if not len(frac):
        return np.zeros((n_layers, n_heads))
    return frac.mean(axis=0).reshape(n_layers, n_heads)


# ----------------------------------------------------------------------------------------- the figures


def index_figures(d: IndexDensity, out_dir: Path, title: str) -> list[Path]:
    """Write the three figures of `FIGURES` into out_dir (an existing folder); -> their paths."""
    paths = [out_dir / name for name in FIGURES]
    _head_density(d, paths[0], title)
    _doc_fractions(d, paths[1], title)
    _density_vs_length(d, paths[2], title)
    return paths


def _head_density(d: IndexDensity, path: Path, title: str) -> None:
    """Two heatmaps, layers down and heads across, on one 0..1 colour scale."""
    from matplotlib.figure import Figure

    n_layers, n_heads = d.la_heads.shape
    # A cell per (layer, head) big enough to see at 100 dpi, on a figure no smaller than the others.
    fig = Figure(figsize=(max(7.0, 4 + 0.3 * n_heads), max(4.0, 2 + 0.22 * n_layers)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, matrix, name in ((axes[0], d.la_heads, "LA: tiles kept"), (axes[1], d.ca_heads, "CA: pages kept")):
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"{name} (mean {matrix.mean():.3f})" if matrix.size else name)
        ax.set_xlabel("head")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="fraction kept, mean over documents")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def _doc_fractions(d: IndexDensity, path: Path, title: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    bins = np.linspace(0.0, 1.0, 41)
    ax.hist(d.doc_la, bins=bins, alpha=0.7, label=f"LA tiles (index: {d.tile_fraction:.3f})")
    ax.hist(d.doc_ca, bins=bins, alpha=0.7, label=f"CA pages (index: {d.page_fraction:.3f})")
    ax.set_xlabel("fraction kept, all layers and heads of one document")
    ax.set_ylabel("documents")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.suptitle(f"{title}: {len(d.n_tokens)} documents")
    fig.savefig(path, dpi=100)


def _density_vs_length(d: IndexDensity, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.scatter(d.n_tokens, d.doc_la, s=10, alpha=0.6, label="LA tiles")
    ax.scatter(d.n_tokens, d.doc_ca, s=10, alpha=0.6, label="CA pages")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("fraction kept")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def mode_summary(path: Path, modes: dict[str, dict[str, dict]], rates: list[tuple[str, str]],
                 seconds: list[tuple[str, str]], title: str) -> None:
    """Per-mode bars with 95% intervals: `rates` (metric, label) on a 0..1 axis on the left, `seconds` on the
    right. modes: mode -> metric -> {"mean": x or None, "ci95": [lo, hi] or None}."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[4, 1])
    width = 0.8 / len(modes)
    panels = ((left, rates), (right, seconds))
    for k, (mode, stats_by_key) in enumerate(modes.items()):
        for ax, keys in panels:
            stats = [stats_by_key[key] for key, _ in keys]
            mean = [s["mean"] or 0.0 for s in stats]
            err = [[m - (s["ci95"] or [m, m])[0] for m, s in zip(mean, stats)],
                   [(s["ci95"] or [m, m])[1] - m for m, s in zip(mean, stats)]]
            ax.bar(np.arange(len(keys)) + k * width, mean, width, yerr=err, capsize=3, label=mode)
    for ax, keys in panels:
        ax.set_xticks(np.arange(len(keys)) + width * (len(modes) - 1) / 2, [label for _, label in keys], fontsize=8)
    left.set_ylim(0, 1.05)
    left.set_ylabel("mean over questions")
    right.set_ylabel("seconds")
    left.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def recall_by_layer(path: Path, recall: dict) -> None:
    """sift-eval --recall: LA / CA recall and sparsity per layer, the paper's figures as dashed lines.
    recall: the report's `recall` section ("layers": [{"layer", "la_recall", ...}], "paper": {...})."""
    from matplotlib.figure import Figure

    layers = [row["layer"] for row in recall["layers"]]
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, kind in zip(axes, ("la", "ca")):
        for metric, style in (("recall", "o-"), ("sparsity", "s-")):
            key = f"{kind}_{metric}"
            values = [np.nan if row[key] is None else row[key] for row in recall["layers"]]
            line = ax.plot(layers, values, style, markersize=3, label=f"{kind.upper()} {metric}")[0]
            if recall["paper"].get(key) is not None:
                ax.axhline(recall["paper"][key], linestyle="--", color=line.get_color(), linewidth=1,
                           label=f"paper {kind.upper()} {metric}")
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("share")
    fig.suptitle(f"In-context recall of the bits: {recall['prompts']} prompts, alpha {recall['alpha']:g}, "
                 f"beta {recall['beta']:g}, tile {recall['tile']}")
    fig.savefig(path, dpi=100)


def pareto_front(path: Path, points: list[dict], front: list[dict], title: str, *, target: float | None = None,
                 chosen: dict | None = None, floor: dict | None = None) -> None:
    """sift-calibrate: agreement with dense against tiles computed, one point per setting, the Pareto front
    joined, grouped by criterion. points / front: {"label", "criterion", "tile_fraction", "agreement"};
    floor: {dtype: {"agreement", ...}}, dense against transformers' dense, drawn as horizontal lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for criterion in sorted({p["criterion"] for p in points}):
        group = [p for p in points if p["criterion"] == criterion]
        ax.scatter([p["tile_fraction"] for p in group], [p["agreement"] for p in group], s=25, label=criterion)
    for p in points:
        ax.annotate(p["label"], (p["tile_fraction"], p["agreement"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ordered = sorted(front, key=lambda p: p["tile_fraction"])
    ax.plot([p["tile_fraction"] for p in ordered], [p["agreement"] for p in ordered], "k--", linewidth=1,
            label="Pareto front")
    if target is not None:
        ax.axhline(target, color="grey", linewidth=1, linestyle=":", label=f"target {target:.0%}")
    for (dtype, f), style in zip((floor or {}).items(), ("-.", (0, (1, 3)), "-")):
        ax.axhline(f["agreement"], color="tab:green", linewidth=1, linestyle=style,
                   label=f"dense = dense ({dtype}) {f['agreement']:.0%}")
    if chosen is not None:
        ax.scatter([chosen["tile_fraction"]], [chosen["agreement"]], s=120, facecolors="none", edgecolors="red",
                   label="chosen")
    ax.set_xlabel("tiles computed (fraction of dense)")
    ax.set_ylabel("whole-answer agreement with dense")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
