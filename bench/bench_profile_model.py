"""Whole-document profiling with an 8B Llama-shaped model (random bf16 weights) vs a plain dense forward of the
same document, on one GPU: time and peak memory at 4K / 16K / 32K / 128K tokens -> bench/results/profile-model.json.

    python bench/bench_profile_model.py [--layers 32] [--lengths 4096,16384,32768,131072] [--variants flash,cudnn]
    python bench/bench_profile_model.py --smoke     # CPU: 2-layer toy model, torch backend, 2 short documents

The profiler is the builder's (`sift.pipeline.profiler.Profiler`, backend "triton"): the model's own forward,
q/k captured through AttentionInterface, an SDPA forward that also returns the layer's log-sum-exp, the Triton
statistics pass and bits kernel. Variants (--variants), each timed in the same run on the same documents:
  flash  lse_source "flash": flash SDPA + lse (isolates the SDPA backend's share);
  cudnn  the builder's default lse_source "auto": cuDNN SDPA + lse, checked once per shape class, else flash
         (the result records which ran): what the builder runs.
Bits of each variant are compared with the first one's (flips = differing bytes; float rounding at a threshold).
"""
from __future__ import annotations

import time

from common import parser, smoke_env

smoke_env()  # before the kernels import triton

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import RESULTS, write_result  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sift.pipeline.config import ProfileConfig  # noqa: E402
from sift.pipeline.profiler import Profiler  # noqa: E402

VARIANTS = ("flash", "cudnn")


class _Tok:  # the profiler only needs the BOS id of a tokenizer
    bos_token_id = 1


def llama8b(layers: int, smoke: bool = False, vocab_size: int | None = None) -> LlamaForCausalLM:
    """Random Llama-3-8B-shaped weights on the GPU (bf16), or with `smoke` a toy model on the CPU (fp32);
    vocab_size: the embedding rows (default 128256, or 1024 for the toy)."""
    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                vocab_size=vocab_size or 1024) if smoke else \
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=vocab_size or 128256)
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
    """A Profiler for one variant (see the module docstring); --smoke: the torch reference backend."""
    if smoke:
        return Profiler(model, _Tok(), ProfileConfig(), "torch")
    return Profiler(model, _Tok(), ProfileConfig(dtype="bfloat16"), "triton",
                    lse_source="flash" if name == "flash" else "auto")


def byte_flips(a, b) -> int:
    """Differing bytes of two documents' packed bits."""
    return int((np.frombuffer(a.la, np.uint8) != np.frombuffer(b.la, np.uint8)).sum()
               + (np.frombuffer(a.ca, np.uint8) != np.frombuffer(b.ca, np.uint8)).sum())


def measure(n: int, model, profilers: dict[str, Profiler], smoke: bool) -> dict:
    """One document of n random tokens: the plain forward, then each variant's profiling."""
    ids = torch.randint(2, 1000 if smoke else 128000, (n,)).tolist()
    reps = 3 if n <= 32768 else 1
    model.set_attn_implementation("sdpa")
    x = torch.tensor([[1] + ids], device="cpu" if smoke else "cuda")
    with torch.inference_mode():
        fwd_ms, fwd_mib, _ = timed(lambda: model.base_model(input_ids=x, use_cache=False), reps)
    row = {"tokens": n, "forward_ms": fwd_ms, "forward_peak_mib": fwd_mib, "variants": {}}
    names = list(profilers)
    first = None
    for v, profiler in profilers.items():
        model.set_attn_implementation("sift_profile")
        prof_ms, prof_mib, bits = timed(lambda: profiler.profile(ids), reps)
        plans = sorted({str(p.source) + ("+expanded KV" if p.expand_kv else "") for p in profiler.lse_plans.values()})
        row["variants"][v] = {"profile_ms": prof_ms, "ratio": prof_ms / fwd_ms, "profile_peak_mib": prof_mib,
                              "lse_plans": plans,
                              f"byte_flips_vs_{names[0]}": None if first is None else byte_flips(first, bits),
                              "la_density": sum(bits.la_density) / len(bits.la_density),
                              "ca_density": sum(bits.ca_density) / len(bits.ca_density)}
        first = first or bits
    return row


def print_table(result: dict) -> None:
    variants = result["variants"]
    print(f"\n{result['device']}  {result['model']}")
    print(f"{'tokens':>8s}{'forward ms':>12s}{'fwd MiB':>9s}" + "".join(
        f"{v + ' ms':>12s}{'ratio':>7s}{'MiB':>8s}{'flips':>7s}" for v in variants))
    for r in result["rows"]:
        line = f"{r['tokens']:8d}{r['forward_ms']:12.1f}{r['forward_peak_mib']:9.0f}"
        for v in variants:
            c = r["variants"][v]
            flips = c[f"byte_flips_vs_{variants[0]}"]
            flips = "-" if flips is None else flips
            line += f"{c['profile_ms']:12.1f}{c['ratio']:7.2f}{c['profile_peak_mib']:8.0f}{flips:>7}"
        print(line)
    if result["rows"]:
        print("lse plans per variant: " + "; ".join(f"{v}: {result['rows'][-1]['variants'][v]['lse_plans']}"
                                                   for v in variants))


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", default="4096,16384,32768,131072", help="document lengths, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants {args.variants!r}: choose from {VARIANTS}")
    if args.smoke:
        args.layers, args.lengths = 2, "64,200"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_profile_model.py times the GPU builder and no GPU is visible; use --smoke on CPU")
    model = llama8b(args.layers, args.smoke)
    profilers = {v: variant_profiler(v, model, args.smoke) for v in variants}
    rows = []
    for n in [int(x) for x in args.lengths.split(",") if x]:
        rows.append(measure(n, model, profilers, args.smoke))
        print(rows[-1], flush=True)
    result = {"model": f"Llama-3-8B shape, {args.layers} layers, random bf16 weights, tile 64" if not args.smoke
              else "toy Llama, 2 layers, fp32, torch backend (smoke)", "variants": variants, "rows": rows}
    # A smoke run never replaces the measured result: it goes to results/smoke/ unless --out says otherwise.
    write_result("profile-model", result, args.out / "smoke" if args.smoke and args.out == RESULTS else args.out)
    print_table({**result, "device": torch.cuda.get_device_name() if not args.smoke else "CPU"})


if __name__ == "__main__":
    main()
