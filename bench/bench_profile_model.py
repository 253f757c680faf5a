"""Whole-document profiling with an 8B Llama-shaped model (random bf16 weights) vs a plain dense forward of
the same document, on one GPU: time and peak memory at 4K / 16K / 32K (and 128K: must not run out of memory).

Run on the GPU machine with the package installed (see bench/device_env.sh), from a folder other than the repo
root:  python3 /path/to/bench/bench_profile_model.py   -> $OUT/profile_model.json and a table.
The profiler is the builder's (`sift.pipeline.profiler.Profiler`, backend "triton"): the model's own forward,
q/k captured through AttentionInterface, flash SDPA for the layer output and its log-sum-exp, the Triton
statistics pass for the bits.
"""
import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sift.pipeline.config import ProfileConfig
from sift.pipeline.profiler import Profiler


class _Tok:  # the profiler only needs the BOS id of a tokenizer
    bos_token_id = 1


def llama8b(layers: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072 + 8, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():  # small weights keep activations finite through random layers
        p.data.normal_(0, 0.02)
    return model.eval()


def timed(fn, reps: int) -> tuple[float, float, object]:
    """Median ms and peak extra MiB of `fn` over `reps` runs after one warm-up; also its last result."""
    result = fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    return sorted(t)[len(t) // 2] * 1e3, peak / 2**20, result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", default="4096,16384,32768,131072")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "profile_model.json"))
    args = ap.parse_args()
    model = llama8b(args.layers)
    profiler = Profiler(model, _Tok(), ProfileConfig(dtype="bfloat16"), "triton")
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(2, 128000, (n,)).tolist()
        reps = 3 if n <= 32768 else 1
        model.set_attn_implementation("sdpa")
        x = torch.tensor([[1] + ids], device="cuda")
        with torch.inference_mode():
            fwd_ms, fwd_mib, _ = timed(lambda: model.base_model(input_ids=x, use_cache=False), reps)
        model.set_attn_implementation("sift_profile")
        prof_ms, prof_mib, bits = timed(lambda: profiler.profile(ids), reps)
        row = {"tokens": n, "forward_ms": fwd_ms, "profile_ms": prof_ms, "ratio": prof_ms / fwd_ms,
               "forward_peak_mib": fwd_mib, "profile_peak_mib": prof_mib,
               "la_density": sum(bits.la_density) / len(bits.la_density),
               "ca_density": sum(bits.ca_density) / len(bits.ca_density)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "model": f"Llama-3-8B shape, {args.layers} layers, random bf16 weights, tile 64", "rows": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{result['device']}  {result['model']}")
    print(f"{'tokens':>8s}{'forward ms':>12s}{'profile ms':>12s}{'ratio':>7s}{'fwd MiB':>10s}{'prof MiB':>10s}")
    for r in rows:
        print(f"{r['tokens']:8d}{r['forward_ms']:12.1f}{r['profile_ms']:12.1f}{r['ratio']:7.2f}"
              f"{r['forward_peak_mib']:10.0f}{r['profile_peak_mib']:10.0f}")


if __name__ == "__main__":
    main()
