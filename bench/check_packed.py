"""Packed profiling on the GPU: each document's bits against those of profiling it alone -> results/check-packed.json.

    python bench/check_packed.py            # H200 (about a minute)
    python bench/check_packed.py --smoke    # CPU, Triton interpreter, tiny shapes: checks that the script runs

1. Kernels, Llama-3-8B layer shape (Hq 32, Hkv 8, D 128, bf16, tile 64), random q / k / v of documents of mixed
   lengths (1 token, not multiples of the tile or the blocks, whole tiles, 4K) packed back to back after a
   1-token prefix:
   a. the pack's bits with the kernels' own first pass against each document alone, the same kernels: equal bit
      for bit (every program cuts its document as it would alone);
   b. what the builder runs: the pack with the lse of flash's varlen forward (`attention_lse`) against each
      document alone with its single-sequence SDPA lse (cuDNN, else flash): every differing bit must be a
      near-threshold case of the fp32 reference (|A - threshold| <= 1e-4 threshold, as bench_profile.py
      counts them); flips are counted and printed;
   c. the pack's attention output and lse (flash varlen, and the kernels' own `attention_packed`) against an
      fp32 softmax per sequence.
2. The whole profiler on SmolLM2's real weights and real text (the sample corpus): a batch packed into forwards
   of 2,048 tokens against each document profiled alone, in bf16 and in fp32 (TF32 off): differing bits counted.
   A document's forward differs between the two only in the row count of its GEMMs (cuBLAS picks other
   kernels), so in bf16 a statistic moves by bf16 rounding through 30 layers and bits near a threshold move
   with it; in fp32 the movement is ~1e-6 and flips should be as rare as near-threshold cells.
Exit status 1 if 1a finds a difference or 1b an unexplained flip. Prints a table last.
"""
from __future__ import annotations

import json
import time

from common import parser, smoke_env

SMOKE = smoke_env()  # before the kernels import triton

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_profile import NEAR_RTOL, dense_oracle, near  # noqa: E402
from common import out_dir, write_result  # noqa: E402

from sift.errors import SiftError  # noqa: E402
from sift.format import n_pages  # noqa: E402
from sift.kernels import profile as pk  # noqa: E402
from sift.kernels.attention_lse import AttentionWithLse, Sequences  # noqa: E402
from sift.kernels.bits import tril_to_square, unpack_msb  # noqa: E402
from sift.kernels.numerics import LOG2E  # noqa: E402
from sift.kernels.packing import PackedDocs  # noqa: E402

PAPER = dict(alpha=0.001, beta=0.01, gamma=0.1)


def shape(smoke: bool) -> dict:
    if smoke:  # the interpreter: fp16 (it mishandles bf16), small heads and blocks
        return dict(dev="cpu", hq=4, hkv=2, d=32, dtype=torch.float16, tile=16, lengths=(1, 23, 16, 5, 45),
                    configs=(pk.ProfileKernelConfig(16, 16), pk.ProfileKernelConfig(16, 16)),
                    fwd=pk.ProfileKernelConfig(16, 16))
    return dict(dev="cuda", hq=32, hkv=8, d=128, dtype=torch.bfloat16, tile=64,
                lengths=(1, 107, 64, 333, 1000, 2048, 77, 4096, 5, 129), configs=None, fwd=None)


def make_pack(s: dict, n_prefix: int = 1, seed: int = 0):
    docs = PackedDocs(n_prefix, s["lengths"], s["tile"])
    g = torch.Generator(device=s["dev"]).manual_seed(seed)

    def rand(h):  # views of [T, H, D], as a transformers forward hands them over; x1.5: peaked rows
        return (torch.randn(docs.total, h, s["d"], generator=g, device=s["dev"]) * 1.5).to(s["dtype"]).transpose(0, 1)

    return docs, rand(s["hq"]), rand(s["hkv"]), rand(s["hkv"])


def pack_bits(q, k, docs, plan, s, **lse):
    la = torch.empty(s["hq"], docs.la_total, dtype=torch.uint8, device=q.device)
    ca = torch.empty(s["hq"], docs.ca_total, dtype=torch.uint8, device=q.device)
    pk.profile_packed(q, k, plan, la_out=la, ca_out=ca, scale=s["d"] ** -0.5, **PAPER, **lse)
    return la, ca


def explain(q, k, rows, n_prefix, tile, la_a, la_b, ca_a, ca_b) -> dict:
    """Flips between two bit sets of one document, each checked against the fp32 reference statistics: an LA flip
    is explained by a near-alpha tile, a CA flip by a page holding a near-beta cell or a near-gamma key."""
    qd, kd = q[:, rows].float(), k[:, rows].float()
    n = rows.stop - rows.start - n_prefix
    p = n_pages(n, tile)
    a, _, tile_max = dense_oracle(qd, kd, n_prefix=n_prefix, tile=tile, scale=q.shape[-1] ** -0.5, softcap=None)
    la_flips = tril_to_square(unpack_msb(la_a, p * (p + 1) // 2), p) != tril_to_square(unpack_msb(la_b, p * (p + 1) // 2), p)
    ca_flips = unpack_msb(ca_a, p) != unpack_msb(ca_b, p)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    counts = ((a >= torch.tensor(PAPER["beta"], dtype=torch.float32, device=q.device)) & causal).sum(1)
    conc = counts.float() / (n - torch.arange(n, device=q.device)).float()
    near_key = (near(a, PAPER["beta"]) & causal).any(1) | near(conc, PAPER["gamma"])
    near_page = torch.nn.functional.pad(near_key, (0, p * tile - n)).reshape(-1, p, tile).any(-1)
    unexplained = int((la_flips & ~near(tile_max, PAPER["alpha"])).sum()) + int((ca_flips & ~near_page).sum())
    return {"la_flips": int(la_flips.sum()), "ca_flips": int(ca_flips.sum()), "la_bits": q.shape[0] * p * (p + 1) // 2,
            "ca_bits": q.shape[0] * p, "unexplained": unexplained}


def kernel_checks(s: dict) -> dict:
    docs, q, k, v = make_pack(s)
    plan = pk.plan_pack(docs, head_dim=s["d"], dtype=s["dtype"], device=s["dev"], configs=s["configs"],
                        fwd_config=s["fwd"])
    args = dict(scale=s["d"] ** -0.5, n_prefix=docs.n_prefix, tile=docs.tile, configs=s["configs"], **PAPER)
    own_la, own_ca = pack_bits(q, k, docs, plan, s)
    exact = 0
    for d in range(len(docs)):
        rows = docs.seq_rows(d)
        alone, _ = pk.profile_layer(q[:, rows], k[:, rows], **args)
        exact += int((alone.la != own_la[:, docs.la_bytes(d)]).sum() + (alone.ca != own_ca[:, docs.ca_bytes(d)]).sum())

    # What the builder runs: the pack's lse from its forward, each document's alone from its own.
    forward = AttentionWithLse("auto")
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    seqs = Sequences.of(docs, plan.cu_seqlens)
    fwd = forward(q4, k4, v4, scale=args["scale"], seqs=seqs)
    out_own, lse2_own = pk.attention_packed(q, k, v, plan, scale=args["scale"])
    if fwd is None:  # no SDPA lse here (the interpreter): the kernels' own forward, as the builder falls back to
        out_fwd, lse_kw = out_own.unsqueeze(0).transpose(1, 2), {"lse2": lse2_own}
    else:
        out_fwd, lse_kw = fwd[0], {"lse": fwd[1]}
    la, ca = pack_bits(q, k, docs, plan, s, **lse_kw)
    flips = {"la_flips": 0, "ca_flips": 0, "la_bits": 0, "ca_bits": 0, "unexplained": 0}
    for d in range(len(docs)):
        rows = docs.seq_rows(d)
        one = forward(q4[:, :, rows], k4[:, :, rows], v4[:, :, rows], scale=args["scale"])
        alone, _ = pk.profile_layer(q[:, rows], k[:, rows], lse=one[1] if one is not None else None, **args)
        found = explain(q, k, rows, docs.n_prefix, docs.tile, la[:, docs.la_bytes(d)], alone.la,
                        ca[:, docs.ca_bytes(d)], alone.ca)
        for key in flips:
            flips[key] += found[key]

    # The pack's forward against fp32 softmax per sequence.
    errors = {}
    g = s["hq"] // s["hkv"]
    for name, out, lse_nat in (("sdpa", out_fwd, lse_kw.get("lse")), ("own", out_own.unsqueeze(0).transpose(1, 2),
                                                                       lse2_own / LOG2E)):
        out_err = lse_err = 0.0
        for d in range(len(docs)):
            r = docs.seq_rows(d)
            qs, ks = q[:, r].float(), k[:, r].float().repeat_interleave(g, 0)
            vs = v[:, r].float().repeat_interleave(g, 0)
            m = qs.shape[1]
            sc = (qs @ ks.transpose(1, 2) * args["scale"]).masked_fill(
                ~torch.ones(m, m, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            out_err = max(out_err, (out[0, :, r].float() - torch.softmax(sc, -1) @ vs).abs().max().item())
            if lse_nat is not None:
                lse_err = max(lse_err, (lse_nat[:, r] - torch.logsumexp(sc, -1)).abs().max().item())
        errors[name] = {"out_max_abs_err": out_err, "lse_max_abs_err": lse_err}
    return {"lengths": list(docs.lengths), "exact_differences": exact, "builder_paths": flips,
            "lse_plans": sorted(f"{p.source}{'+expanded KV' if p.expand_kv else ''}" for p in forward.plans.values()),
            "forward_errors": errors}


def profiler_checks(smoke: bool) -> list[dict]:
    from sift.model import load_model
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.corpus import SAMPLE_CORPUS
    from sift.pipeline.profiler import Profiler

    texts = [json.loads(line)["text"] for line in
             (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text().splitlines()][: 6 if smoke else 120]
    out = []
    for dtype in (["float32"] if smoke else ["bfloat16", "float32"]):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        try:
            model, tok, _ = load_model("smollm2-135m-instruct", dtype=dtype, device="cpu" if smoke else "cuda")
        except (SiftError, OSError) as e:   # a GPU host without the default model's weights: part 2 not run
            print(f"SmolLM2 part skipped: {str(e).splitlines()[0]}", flush=True)
            return out
        profiler = Profiler(model, tok, ProfileConfig(dtype=dtype), "torch" if smoke else "triton",
                            batch_tokens=512 if smoke else 2048)
        docs = [tok(t, add_special_tokens=False).input_ids for t in texts]
        t0 = time.perf_counter()
        batch = profiler.profile_batch(docs)
        packed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        alone = [profiler.profile(d) for d in docs]
        alone_s = time.perf_counter() - t0
        bits = flips = docs_same = 0
        for b, a in zip(batch, alone):
            x = np.unpackbits(np.frombuffer(b.la + b.ca, np.uint8))
            y = np.unpackbits(np.frombuffer(a.la + a.ca, np.uint8))
            bits += x.size
            flips += int((x != y).sum())
            docs_same += int((x == y).all())
        out.append({"dtype": dtype, "documents": len(docs), "tokens": sum(map(len, docs)), "bits": bits,
                    "flipped_bits": flips, "documents_identical": docs_same, "packed_seconds": packed_s,
                    "alone_seconds": alone_s, "backend": profiler.backend_label})
        del model, profiler
        if not smoke:
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("check_packed.py checks the GPU kernels and no GPU is visible; use --smoke on CPU")
    t0 = time.time()
    kernels = kernel_checks(shape(SMOKE))
    profilers = profiler_checks(SMOKE)
    ok = kernels["exact_differences"] == 0 and kernels["builder_paths"]["unexplained"] == 0
    result = {"smoke": SMOKE, "near_rtol": NEAR_RTOL, "kernels": kernels, "profiler": profilers, "ok": ok,
              "elapsed_s": time.time() - t0}
    write_result("check-packed", result, out_dir(args))
    f = kernels["builder_paths"]
    print(f"\nkernels (lengths {kernels['lengths']}): pack vs alone, same kernels: {kernels['exact_differences']} "
          f"differing bytes; builder paths ({kernels['lse_plans']}): LA {f['la_flips']}/{f['la_bits']}, "
          f"CA {f['ca_flips']}/{f['ca_bits']} flips, {f['unexplained']} unexplained")
    for name, e in kernels["forward_errors"].items():
        print(f"  forward {name}: output max abs err {e['out_max_abs_err']:.3g}, lse {e['lse_max_abs_err']:.3g}")
    print(f"{'profiler':10s}{'docs':>6s}{'tokens':>8s}{'bits':>10s}{'flipped':>9s}{'same docs':>10s}"
          f"{'packed s':>9s}{'alone s':>9s}  backend")
    for r in profilers:
        print(f"{r['dtype']:10s}{r['documents']:6d}{r['tokens']:8d}{r['bits']:10d}{r['flipped_bits']:9d}"
              f"{r['documents_identical']:10d}{r['packed_seconds']:9.2f}{r['alone_seconds']:9.2f}  {r['backend']}")
    print(f"ok={ok} elapsed {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
