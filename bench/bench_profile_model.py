"""Whole-document profiling with an 8B Llama-shaped model (random bf16 weights) vs a plain dense forward of
the same document, on one GPU: time and peak memory at 4K / 16K / 32K (and 128K: must not run out of memory).

Run on the GPU machine with the package installed (see bench/device_env.sh), from a folder other than the repo
root:  python3 /path/to/bench/bench_profile_model.py   -> $OUT/profile_model.json and a table.
The profiler is the builder's (`sift.pipeline.profiler.Profiler`, backend "triton"): the model's own forward,
q/k captured through AttentionInterface, an SDPA forward that also returns the layer's log-sum-exp, the Triton
statistics pass and bits kernel. Variants (--variants), each timed in the same run on the same documents:
  old    flash SDPA + lse, the stats pass with pointer-loaded q (its default before TMA), torch finish_bits
         (the path measured on 2026-11-29);
  flash  flash SDPA + lse, today's kernel defaults (isolates the SDPA backend's share);
  cudnn  the builder's default lse source "auto": cuDNN SDPA + lse, checked once per shape class, else flash
         (the table's last line prints which ran), today's defaults: what the builder runs now.
Bits of each variant are compared with the first one's (flips = differing bytes; float rounding at a threshold).
Without a GPU: --smoke runs a 2-layer toy model on the CPU (torch reference backend; nothing timed that matters).
"""
import argparse
import functools
import json
import os
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sift.kernels import profile as pk
from sift.pipeline.config import ProfileConfig
from sift.pipeline.profiler import Profiler

VARIANTS = ("old", "flash", "cudnn")
OLD_STATS = pk.KernelConfig(128, 128, 8, 3)  # the stats pass's default before TMA


class _Tok:  # the profiler only needs the BOS id of a tokenizer
    bos_token_id = 1


def llama8b(layers: int, smoke: bool = False) -> LlamaForCausalLM:
    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                vocab_size=1024) if smoke else \
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256)
    cfg = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=131072 + 8,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **size)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    with torch.device("cpu" if smoke else "cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():  # small weights keep activations finite through random layers
        p.data.normal_(0, 0.02)
    return model.eval()


def timed(fn, reps: int) -> tuple[float, float, object]:
    """Median ms and peak extra MiB of `fn` over `reps` runs after one warm-up; also its last result."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = fn()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        t.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return sorted(t)[len(t) // 2] * 1e3, peak, result


def variant_profiler(name: str, model, smoke: bool) -> Profiler:
    """A Profiler for one variant (see the module docstring); `use` before profiling with it."""
    if smoke:
        return Profiler(model, _Tok(), ProfileConfig(), "torch")
    return Profiler(model, _Tok(), ProfileConfig(dtype="bfloat16"), "triton",
                    lse_source="flash" if name in ("old", "flash") else "auto")


def use(name: str, original=pk.profile_layer) -> None:
    """Point the profiler's `profile_layer` (looked up at each call) at the variant's kernel settings."""
    if name == "old":
        pk.profile_layer = functools.partial(original, configs=(pk.default_configs(64, 128, torch.bfloat16)[0],
                                                                OLD_STATS), bits="torch")
    else:
        pk.profile_layer = original


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", default="4096,16384,32768,131072")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    ap.add_argument("--smoke", action="store_true", help="CPU: 2-layer toy model, torch backend, 2 short documents")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "profile_model.json"))
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants {args.variants!r}: choose from {VARIANTS}")
    if smoke:
        args.layers, args.lengths, variants = 2, "64,200", variants[:2]
    model = llama8b(args.layers, smoke)
    device = "cpu" if smoke else "cuda"
    profilers = {v: variant_profiler(v, model, smoke) for v in variants}
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(2, 1000 if smoke else 128000, (n,)).tolist()
        reps = 3 if n <= 32768 else 1
        model.set_attn_implementation("sdpa")
        x = torch.tensor([[1] + ids], device=device)
        with torch.inference_mode():
            fwd_ms, fwd_mib, _ = timed(lambda: model.base_model(input_ids=x, use_cache=False), reps)
        row = {"tokens": n, "forward_ms": fwd_ms, "forward_peak_mib": fwd_mib, "variants": {}}
        first = None
        for v in variants:
            use(v)
            model.set_attn_implementation("sift_profile")
            prof_ms, prof_mib, bits = timed(lambda: profilers[v].profile(ids), reps)
            use("flash")  # the original profile_layer again
            flips = None if first is None else \
                int((np.frombuffer(first.la, np.uint8) != np.frombuffer(bits.la, np.uint8)).sum()
                    + (np.frombuffer(first.ca, np.uint8) != np.frombuffer(bits.ca, np.uint8)).sum())
            first = first or bits
            plans = sorted({str(p.source) + ("+expanded KV" if p.expand_kv else "")
                            for p in profilers[v].lse_plans.values()})
            row["variants"][v] = {"profile_ms": prof_ms, "ratio": prof_ms / fwd_ms, "profile_peak_mib": prof_mib,
                                  "lse_plans": plans, f"byte_flips_vs_{variants[0]}": flips,
                                  "la_density": sum(bits.la_density) / len(bits.la_density),
                                  "ca_density": sum(bits.ca_density) / len(bits.ca_density)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if not smoke else "cpu smoke",
              "model": f"Llama-3-8B shape, {args.layers} layers, random bf16 weights, tile 64" if not smoke
              else "toy Llama, 2 layers, fp32 (smoke)", "variants": variants, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{result['device']}  {result['model']}")
    print(f"{'tokens':>8s}{'forward ms':>12s}{'fwd MiB':>9s}" + "".join(
        f"{v + ' ms':>12s}{'ratio':>7s}{'MiB':>8s}{'flips':>7s}" for v in variants))
    for r in rows:
        line = f"{r['tokens']:8d}{r['forward_ms']:12.1f}{r['forward_peak_mib']:9.0f}"
        for v in variants:
            c = r["variants"][v]
            flips = c[f"byte_flips_vs_{variants[0]}"]
            flips = "-" if flips is None else flips
            line += f"{c['profile_ms']:12.1f}{c['ratio']:7.2f}{c['profile_peak_mib']:8.0f}{flips:>7}"
        print(line)
    print("goal: ratio <= 1.3 at 4K / 16K / 32K; lse plans per variant: " +
          "; ".join(f"{v}: {rows[-1]['variants'][v]['lse_plans']}" for v in variants if rows))


if __name__ == "__main__":
    main()
