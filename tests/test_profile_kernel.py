"""The Triton profiling kernel (`sift.kernels.profile`) against the torch reference (`profile_ref`).

The kernels run on tests/helpers.py DEVICE: the GPU, or without one the Triton interpreter (tests/conftest.py),
so shapes and blocks are small; the references run on the CPU. fp32 inputs take IEEE `tl.dot` products (the
launcher's choice), so the fp32 tolerances hold on the GPU too.

Statistics are compared with tolerances against a dense oracle (the full softmax of a small layer, computed
here); bits against `profile_layer_ref`. The kernel computes A with exp2 from a row log-sum-exp while the
reference uses torch.softmax, so a probability within float rounding of a threshold may land on the other
side: every differing count or bit ("flip") must be explained by such a near-threshold cell, and flips are
printed (run with -s to see them).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from sift.format import n_pages
from sift.kernels.bits import tril_to_square, unpack_msb
from sift.kernels.profile import ProfileKernelConfig, profile_layer, profile_stats
from sift.kernels.profile_ref import LayerBits, finish_bits, profile_layer_ref

from .helpers import DEVICE

NEAR_RTOL = 1e-4  # |A - threshold| <= NEAR_RTOL * threshold: a cell whose side may differ from the reference
STAT_RTOL = 1e-4  # fp32 statistics: relative error of the tile maxima


@dataclass(frozen=True)
class Case:
    hq: int = 4
    hkv: int = 2
    n_doc: int = 70
    n_prefix: int = 1
    d: int = 64
    tile: int = 16
    blocks: tuple[int, int] = (32, 16)  # (block_m, block_n) of both passes
    key_rows: bool = False  # stats pass scores laid out [keys, queries]
    tma: bool = False  # stats pass streams q through a tensor descriptor
    thresholds: tuple[float, float, float] | None = None  # (alpha, beta, gamma); None: midpoints of the data
    ca_normalize: str = "causal"
    softcap: float | None = None
    dense_heads: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    strided: bool = False  # q / k as views of [Lp, H, D]
    seed: int = 0


CASES = {
    "base": Case(),
    "base_key_rows": Case(key_rows=True),
    "gqa1": Case(hq=2, hkv=2),
    "gqa3": Case(hq=3, hkv=1, n_doc=45, key_rows=True),
    "gqa4_d128": Case(hq=4, hkv=1, d=128, n_doc=50, key_rows=True),
    "tile32_multi_tile_blocks": Case(tile=32, blocks=(64, 32), n_doc=101),
    "tile64": Case(tile=64, blocks=(64, 64), n_doc=133, hq=2, hkv=1, key_rows=True),
    "tile16_wide_blocks": Case(tile=16, blocks=(64, 32), n_doc=83),  # 4 x 2 tiles per block
    "tile16_wide_blocks_key_rows": Case(tile=16, blocks=(32, 64), n_doc=83, key_rows=True),
    "small_blocks": Case(blocks=(16, 16), n_doc=37, hq=2, key_rows=True),
    "no_prefix": Case(n_prefix=0),
    "long_prefix": Case(n_prefix=21, n_doc=40, key_rows=True),
    "one_token_doc": Case(n_prefix=5, n_doc=1, key_rows=True),
    "one_token_doc_no_prefix": Case(n_prefix=0, n_doc=1, hq=2, hkv=1),
    "whole_tiles": Case(n_doc=64),
    "paper_thresholds": Case(thresholds=(0.001, 0.01, 0.1)),
    "thresholds_0": Case(thresholds=(0.0, 0.0, 0.0), key_rows=True),
    "thresholds_1": Case(thresholds=(1.0, 1.0, 1.0), n_prefix=0),
    "thresholds_1_key_rows": Case(thresholds=(1.0, 1.0, 1.0), n_prefix=0, key_rows=True, hq=2, n_doc=40),
    "key_index": Case(ca_normalize="key_index"),
    "softcap": Case(softcap=5.0, key_rows=True),
    "dense_heads": Case(dense_heads=(0, 3)),
    "fp16": Case(dtype=torch.float16),
    "fp16_gqa4_d128": Case(dtype=torch.float16, hq=4, hkv=1, d=128, tile=32, blocks=(32, 32), n_doc=60,
                           key_rows=True),
    "strided": Case(strided=True, n_prefix=3, key_rows=True),
    "thresholds_0_query_rows": Case(thresholds=(0.0, 0.0, 0.0), n_doc=45),
    "d48": Case(d=48, n_doc=50),
    "tma": Case(tma=True),
    "tma_key_rows_strided": Case(tma=True, key_rows=True, strided=True, n_prefix=3),
    "tma_fp16_gqa4_d128": Case(tma=True, dtype=torch.float16, hq=4, hkv=1, d=128, tile=32, blocks=(32, 32),
                               n_doc=60, strided=True),
    "tma_d48_no_prefix": Case(tma=True, d=48, n_doc=50, n_prefix=0),  # columns past D padded by the descriptor
    "tma_paper_thresholds_one_token": Case(tma=True, thresholds=(0.001, 0.01, 0.1), n_doc=1, n_prefix=2),
}


def _inputs(c: Case, device="cpu"):
    """(q [Hq, Lp, D], k [Hkv, Lp, D]) on `device`, drawn on the CPU (the same values on every device)."""
    g = torch.Generator().manual_seed(c.seed)
    lp = c.n_prefix + c.n_doc
    # N(0, 1) * 1.5 with scale 1/sqrt(D): score std ~2.3, so rows are peaked like a trained model's.
    q = torch.randn(lp, c.hq, c.d, generator=g) * 1.5
    k = torch.randn(lp, c.hkv, c.d, generator=g) * 1.5
    q, k = q.to(c.dtype).to(device), k.to(c.dtype).to(device)
    if c.strided:
        return q.transpose(0, 1), k.transpose(0, 1)
    return q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()


def _dense_probs(q, k, *, scale, softcap):
    """[Hq, Lp, Lp] fp32 softmax, computed like `profile_layer_ref` (on fp32 copies of the inputs)."""
    q, k = q.float(), k.float().repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    lp = q.shape[1]
    causal = torch.ones(lp, lp, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32), torch.logsumexp(s, dim=-1)


def _oracle(a, *, n_prefix, tile, beta):
    """Document part of A -> (tile_max [Hq, P, P], key_counts [Hq, L], causal doc mask [L, L])."""
    ad = a[:, n_prefix:, n_prefix:]
    hq, n, _ = ad.shape
    p = n_pages(n, tile)
    padded = torch.nn.functional.pad(ad, (0, p * tile - n, 0, p * tile - n))
    tile_max = padded.reshape(hq, p, tile, p, tile).amax(dim=(2, 4))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    counts = ((ad >= torch.tensor(beta, dtype=torch.float32)) & causal).sum(dim=1)
    return tile_max, counts, causal


def _midpoint(values: torch.Tensor, quantile: float) -> float:
    """A threshold between two adjacent data values (mixed bits, no cell exactly on it)."""
    v = values.flatten().double().sort().values
    i = min(max(int(quantile * (v.numel() - 1)), 0), v.numel() - 2) if v.numel() > 1 else 0
    if v.numel() == 1:
        return float(v[0]) * 0.5
    return float((v[i] + v[i + 1]) / 2)


def _near(x: torch.Tensor, threshold: float) -> torch.Tensor:
    return (x.double() - threshold).abs() <= NEAR_RTOL * threshold


def _square_la(la, p):
    return tril_to_square(unpack_msb(la, p * (p + 1) // 2), p)


def _run_case(c: Case):
    q, k = _inputs(c, DEVICE)
    scale = c.d ** -0.5
    a, lse_ref = _dense_probs(q.cpu(), k.cpu(), scale=scale, softcap=c.softcap)
    n = c.n_doc
    p = n_pages(n, c.tile)
    tm_pre, _, causal = _oracle(a, n_prefix=c.n_prefix, tile=c.tile, beta=0.0)
    ad = a[:, c.n_prefix:, c.n_prefix:]
    if c.thresholds is None:
        tril = torch.ones(p, p, dtype=torch.bool).tril()
        alpha = _midpoint(tm_pre[:, tril], 0.5)
        beta = _midpoint(ad[:, causal], 0.9)
    else:
        alpha, beta, gamma = c.thresholds
    tm_ref, counts_ref, _ = _oracle(a, n_prefix=c.n_prefix, tile=c.tile, beta=beta)
    if c.thresholds is None:
        keys = torch.arange(n)
        denom = (n - keys) if c.ca_normalize == "causal" else (keys + 1)
        gamma = min(_midpoint(counts_ref.float() / denom, 0.95), 1.0)

    configs = (ProfileKernelConfig(*c.blocks), ProfileKernelConfig(*c.blocks, key_rows=c.key_rows, tma=c.tma))
    stats = profile_stats(q, k, scale=scale, n_prefix=c.n_prefix, tile=c.tile, beta=beta, softcap=c.softcap,
                          configs=configs)
    stats_lse, tile_max, key_counts = stats.lse.cpu(), stats.tile_max.cpu(), stats.key_counts.cpu()

    # Row log-sum-exp of the document rows.
    lse_err = (stats_lse - lse_ref[:, c.n_prefix:]).abs().max().item()
    print(f"\n{c}\n  lse max abs err {lse_err:.3g}")
    assert lse_err <= 1e-5 * max(1.0, lse_ref.abs().max().item())

    # Tile maxima: lower triangle within tolerance, upper triangle 0.
    tril = torch.ones(p, p, dtype=torch.bool).tril()
    err = (tile_max - tm_ref).abs()
    rel = (err / tm_ref.clamp_min(1e-30))[:, tril]
    print(f"  tile_max max abs err {err.max().item():.3g}, max rel err {rel.max().item():.3g}")
    assert bool((err[:, tril] <= STAT_RTOL * tm_ref[:, tril] + 1e-12).all())
    assert bool((tile_max[:, ~tril] == 0).all())

    # Key counts: every difference is a near-beta cell of that key's column.
    near_cells = (_near(ad, beta) & causal).sum(dim=1)
    count_diff = (key_counts.long() - counts_ref).abs()
    print(f"  key_counts flips {int(count_diff.sum())} (near-beta cells {int(near_cells.sum())})")
    assert bool((count_diff <= near_cells).all()), (count_diff, near_cells)

    # Bits, end to end (the first pass is checked above; reuse its lse to keep the interpreter run short).
    args = dict(scale=scale, n_prefix=c.n_prefix, tile=c.tile, alpha=alpha, beta=beta, gamma=gamma,
                softcap=c.softcap, ca_normalize=c.ca_normalize, dense_heads=c.dense_heads)
    lse_full = torch.zeros(c.hq, c.n_prefix + n, device=DEVICE)
    lse_full[:, c.n_prefix:] = stats.lse
    bits, out = profile_layer(q, k, lse=lse_full, configs=configs, **args)
    bits = LayerBits(la=bits.la.cpu(), ca=bits.ca.cpu())
    ref, _ = profile_layer_ref(q.cpu().float(), k.cpu().float(), **args)
    assert out is None
    assert bits.la.dtype == torch.uint8 and bits.la.shape == ref.la.shape
    assert bits.ca.dtype == torch.uint8 and bits.ca.shape == ref.ca.shape
    la_k, la_r = _square_la(bits.la, p), _square_la(ref.la, p)
    ca_k, ca_r = unpack_msb(bits.ca, p), unpack_msb(ref.ca, p)
    la_flips = la_k != la_r
    ca_flips = ca_k != ca_r
    print(f"  LA flips {int(la_flips.sum())} / {c.hq * p * (p + 1) // 2}, CA flips {int(ca_flips.sum())} / "
          f"{c.hq * p}; LA density {la_r.sum().item() / (c.hq * p * (p + 1) / 2):.2f}, "
          f"CA density {ca_r.float().mean().item():.2f}")
    assert not bool((la_flips & ~_near(tm_ref, alpha)).any()), "LA flip not explained by a near-alpha tile"
    key_moved = torch.nn.functional.pad(count_diff > 0, (0, p * c.tile - n)).reshape(c.hq, p, c.tile).any(-1)
    assert not bool((ca_flips & ~key_moved).any()), "CA flip without a count difference in the page"
    for h in c.dense_heads:
        assert bool(la_k[h][tril].all()) and bool(ca_k[h].all())
    return int(count_diff.sum()) + int(la_flips.sum()) + int(ca_flips.sum())


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    flips = _run_case(CASES[name])
    # fp32 / fp16 inputs: the kernel and the reference agree up to rounding; flips must be rare.
    assert flips <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_defaults_without_lse_and_in_head_chunks(dtype):
    """Default launch parameters, the first pass inside profile_layer, heads split over chunks (dense heads
    renumbered per chunk)."""
    c = Case(hq=4, hkv=2, n_doc=50, n_prefix=2, dense_heads=(2,), dtype=dtype)
    q, k = _inputs(c, DEVICE)
    args = dict(scale=c.d ** -0.5, n_prefix=c.n_prefix, tile=c.tile, alpha=0.02, beta=0.05, gamma=0.2,
                dense_heads=c.dense_heads)
    ref, _ = profile_layer_ref(q.cpu().float(), k.cpu().float(), **args)
    p = n_pages(c.n_doc, c.tile)
    whole, _ = profile_layer(q, k, **args)
    chunked, _ = profile_layer(q, k, stats_bytes=p * p * 4, **args)  # one head per chunk
    assert torch.equal(chunked.la, whole.la) and torch.equal(chunked.ca, whole.ca)
    # The reference's finish_bits on the kernel's own statistics gives the same bits as the bits kernel.
    stats = profile_stats(q, k, scale=args["scale"], n_prefix=c.n_prefix, tile=c.tile, beta=args["beta"])
    torch_bits = finish_bits(stats.tile_max.cpu(), stats.key_counts.cpu(), c.n_doc, tile=c.tile,
                             alpha=args["alpha"], gamma=args["gamma"], ca_normalize="causal", force_sink_page=True,
                             dense_heads=c.dense_heads)
    whole = LayerBits(la=whole.la.cpu(), ca=whole.ca.cpu())
    assert torch.equal(torch_bits.la, whole.la) and torch.equal(torch_bits.ca, whole.ca)
    flips = int((unpack_msb(whole.la, p * (p + 1) // 2) != unpack_msb(ref.la, p * (p + 1) // 2)).sum()) \
        + int((unpack_msb(whole.ca, p) != unpack_msb(ref.ca, p)).sum())
    print(f"\n{dtype}: {flips} bit flips against the reference")
    assert flips == 0 if dtype == torch.float32 else flips <= 2


def test_rejects_bad_input():
    c = Case(n_doc=20)
    q, k = _inputs(c, DEVICE)
    args = dict(scale=0.125, n_prefix=1, tile=16, alpha=0.001, beta=0.01, gamma=0.1)
    with pytest.raises(ValueError, match="dtype"):
        profile_layer(q.double(), k.double(), **args)
    with pytest.raises(ValueError, match="share dtype"):
        profile_layer(q, k.half(), **args)
    with pytest.raises(ValueError, match="lse must be"):
        profile_layer(q, k, lse=torch.zeros(c.hq, 5, device=DEVICE), **args)
    with pytest.raises(ValueError, match="dense_heads"):
        profile_layer(q, k, dense_heads=(c.hq,), **args)
    with pytest.raises(ValueError, match="softcap"):
        profile_layer(q, k, **{**args, "softcap": 0.0})
    with pytest.raises(ValueError, match="tile"):
        profile_layer(q, k, **{**args, "tile": 8})
    with pytest.raises(ValueError, match="multiples of tile"):
        profile_layer(q, k, configs=(ProfileKernelConfig(32, 16), ProfileKernelConfig(32, 16)), **{**args, "tile": 32})
    with pytest.raises(ValueError, match="n_prefix"):
        profile_layer(q, k, **{**args, "n_prefix": q.shape[1]})


@pytest.mark.parametrize("n_doc,tile,normalize,sink,dense", [
    (1, 16, "causal", True, ()),
    (70, 16, "causal", True, ()),
    (133, 32, "key_index", False, (1,)),
    (300, 64, "causal", False, (0, 2)),
    (1000, 128, "key_index", True, ()),
    (4000, 16, "causal", True, (2,)),  # P = 250: LA rows straddle bytes, several LA and CA programs
])
def test_bits_kernel_matches_finish_bits(n_doc, tile, normalize, sink, dense):
    """The bit-packing kernel against the torch `finish_bits` on the same statistics: exactly equal, with
    tile maxima and concentrations placed exactly on, just below and just above the thresholds."""
    from sift.kernels.packing import PackedDocs
    from sift.kernels.profile import LA_BYTES_PER_PROGRAM, _launch_bits, plan_pack
    from sift.kernels.profile_ref import finish_bits

    hq, alpha, gamma = 3, 0.001, 0.25
    p = n_pages(n_doc, tile)
    g = torch.Generator().manual_seed(n_doc)
    a32 = torch.tensor(alpha, dtype=torch.float32)
    around = torch.stack([a32, torch.nextafter(a32, torch.tensor(0.0)), torch.nextafter(a32, torch.tensor(1.0))])
    tile_max = torch.rand(hq, p, p, generator=g) * 0.002
    pick = torch.rand(hq, p, p, generator=g) < 0.3
    tile_max[pick] = around[torch.randint(0, 3, (int(pick.sum()),), generator=g)]
    upper = torch.ones(p, p, dtype=torch.bool).triu(1)
    tile_max = tile_max.masked_fill(upper, 7.0)  # garbage above the diagonal (>= alpha): must never be read
    keys = torch.arange(n_doc)
    denom = (n_doc - keys) if normalize == "causal" else (keys + 1)
    # counts / denom near gamma = 1/4 for a few keys a page (exactly on it where denom % 4 == 0, else on either
    # side), about gamma / 2 for the others: pages hot and cold.
    counts = (denom.float() * gamma).floor().long() + torch.randint(-1, 2, (hq, n_doc), generator=g)
    counts = counts.clamp(0).minimum(denom)
    counts = torch.where(torch.rand(hq, n_doc, generator=g) < 4.0 / tile, counts, counts // 2).to(torch.int32)
    ref = finish_bits(tile_max, counts, n_doc, tile=tile, alpha=alpha, gamma=gamma, ca_normalize=normalize,
                      force_sink_page=sink, dense_heads=dense)
    la = torch.full_like(ref.la, 0xAA, device=DEVICE)
    ca = torch.full_like(ref.ca, 0xAA, device=DEVICE)
    flags = torch.zeros(hq, dtype=torch.uint8)
    flags[list(dense)] = 1
    plan = plan_pack(PackedDocs(0, (n_doc,), tile), head_dim=16, dtype=torch.float32, device=DEVICE)
    tile_max, counts, flags = tile_max.to(DEVICE), counts.to(DEVICE), flags.to(DEVICE)
    for h0, h1 in ((0, 1), (1, hq)):  # two head chunks, as profile_packed launches them
        _launch_bits(tile_max[h0:h1].reshape(h1 - h0, p * p), counts, flags if dense else None, la, ca,
                     range(h0, h1), plan, alpha=alpha, gamma=gamma, ca_normalize=normalize, force_sink_page=sink)
    la, ca = la.cpu(), ca.cpu()
    assert ref.la.shape[1] > LA_BYTES_PER_PROGRAM or n_doc < 4000
    print(f"\nLA density {unpack_msb(ref.la, p * (p + 1) // 2).float().mean():.2f}, "
          f"CA density {unpack_msb(ref.ca, p).float().mean():.2f}")
    assert torch.equal(la, ref.la), (la != ref.la).nonzero()[:10]
    assert torch.equal(ca, ref.ca), (ca != ref.ca).nonzero()[:10]
