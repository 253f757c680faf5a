"""Check the engine's captured decode step (CUDA graphs, runtime/runner.py) against the same step run eagerly ->
bench/results/check-decode-graph.json.

Three engines share one model: one replays the decode step captured per batch-size bucket, one runs the same
step eagerly (cuda_graphs=False), both with the fast decode forward for Llama-structured models
(runtime/llama_decode.py: stacked projections, fused element-wise kernels); the third runs the step eagerly
through the model's own modules (its fast forward switched off). All take the same requests through the step API
(greedy, 33 tokens: the prefill's and 32 decode steps) at batch 1, 3 and 8 (3 runs in the bucket of 4: rows past
the live ones are padding); after every step the logits of the live rows are compared.

Models: an 8B-shaped Llama (32 layers, 32 / 8 heads, head_dim 128, hidden 4096, vocab 128256) with random bf16
weights made on the device, random-token prompts of 1-3K tokens; and SmolLM2-135M-Instruct in bf16 on HotpotQA
prompts when it is installed.

Pass, per model and batch: greedy ids equal at every step, and the logits within TOLERANCE_EPS bf16 epsilons of
the eager step's largest logit: both run the same kernels in the same order on the same inputs, so they differ
at most by the rounding of a different cuBLAS algorithm choice (none is expected: the measured difference is
printed). Also: decode-only steps of the captured engine make no synchronising torch call
(`torch.cuda.set_sync_debug_mode("error")`); the fast forward serves the model; and the captured fast step
agrees with the module forward: logits within MODULE_TOLERANCE_EPS bf16 epsilons of the largest logit (the two
round differently: one GEMM over stacked weights against three, fused kernels against torch's element-wise ops,
through every layer), compared up to the first step where a row's greedy token differs, which is allowed only
where the module forward's two best logits lie within that tolerance (a near tie). Exit status 1 if a check
fails.

    python bench/check_decode_graph.py            # a CUDA GPU (~3 minutes on an H200)
    python bench/check_decode_graph.py --smoke    # a tiny model on CPU, every engine eager, backend triton in
                                                  # the interpreter, batch 1 and 3: checks the script runs
"""
from __future__ import annotations

import json
import sys
import time
import warnings

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402

from sift.errors import SiftError  # noqa: E402
from sift.runtime import Request, SamplingParams, SiftEngine  # noqa: E402

# Relative to the eager step's largest |logit|: a few units of bf16 rounding (2**-7 each).
TOLERANCE_EPS = 4
MODULE_TOLERANCE_EPS = 8
BATCHES = (1, 3, 8)


def llama(smoke: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if smoke:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2)
        device, dtype = "cpu", torch.float32
    else:
        cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
        device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(1)
    scale = 16 if smoke else 1

    def text(n: int) -> str:
        ids = torch.randint(3, cfg.vocab_size, (max(1, n // scale),), generator=gen).tolist()
        return " ".join(map(str, ids))

    reqs = [Request("", [(f"d{r}", text(1000 + 173 * r)), (f"e{r}", text(700 + 31 * r))], text(300 + r))
            for r in range(max(BATCHES))]
    # Random weights put no token near the top: no eos stops a request early.
    return model, IdTokenizer(cfg.bos_token_id, cfg.eos_token_id), reqs


def smollm2():
    try:
        from sift.model import DEFAULT_MODEL, load_model
        from sift.quality.prompts import hotpot_request, load_questions

        model, tokenizer, _ = load_model(DEFAULT_MODEL, dtype="bfloat16", device="cuda")
    except (SiftError, ImportError, OSError) as e:
        print(f"SmolLM2 part skipped: {e}", flush=True)
        return None
    return model, tokenizer, [hotpot_request(q) for q in load_questions(max(BATCHES))]


def drive(engine: SiftEngine, reqs: list[Request], steps: int, check_syncs: bool):
    """Run `reqs` through the step API -> (per decode step, the live rows' fp32 logits [n, V] on the CPU; final
    ids; seconds per decode-only step; synchronising torch calls seen in decode-only steps)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0)
    ids = [engine.add_request(r, params, "dense") for r in reqs]
    logits, last, times, syncs = [], {}, [], 0
    first = True
    while engine.has_unfinished():
        launches = engine.runner.launches
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            guard = check_syncs and not first and torch.cuda.is_available()
            if guard:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                outs = engine.step()
            finally:
                if guard:
                    torch.cuda.set_sync_debug_mode(0)
        # torch's notice that the sync debug mode is a prototype (once per process) names no synchronising call
        found = [str(w.message) for w in seen
                 if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
        syncs += len(found)
        for message in found:   # which call synchronised, with the step it happened in
            print(f"step {len(times) + 1}: {message.splitlines()[0][:200]}", flush=True)
        if not first:
            times.append(time.perf_counter() - t)
        first = False
        for o in outs:
            last[o.request_id] = o
        if engine.runner.launches != launches:
            logits.append(engine.runner.last_logits[:engine.runner.n_rows].float().cpu())
    return logits, [last[i].token_ids for i in ids], times, syncs


def agreement(fast: list[torch.Tensor], module: list[torch.Tensor], tol: float) -> tuple[float, int, bool]:
    """Per step logits [n, V] of the fast and the module forward -> (largest relative difference, steps compared,
    ok): compared up to the first step where a row's greedy token differs (their inputs differ afterwards); a
    differing token is allowed only where the module's two best logits are within the tolerance."""
    worst, ok, steps = 0.0, True, 0
    for f, m in zip(fast, module):
        scale = m.abs().max()
        rel = float((f - m).abs().max() / scale)
        worst, steps = max(worst, rel), steps + 1
        ok &= rel <= tol
        differ = f.argmax(-1) != m.argmax(-1)
        if differ.any():
            top2 = m[differ].topk(2, dim=-1).values
            ok &= bool(((top2[:, 0] - top2[:, 1]) <= 2 * tol * scale).all())
            break
    return worst, steps, ok


def check(name: str, model, tokenizer, reqs: list[Request], steps: int, smoke: bool) -> list[dict]:
    kv = 8 << 30 if not smoke else 32 << 20   # 8 requests of ~2.5K tokens: 2.6 GB of bf16 KV in the 8B shape
    # --smoke: backend triton in the interpreter, so that the fast forward (Triton kernels only) runs on CPU
    backend = "triton" if smoke else "auto"
    graphs = SiftEngine(model, tokenizer, None, kv_cache_bytes=kv, cuda_graphs=not smoke, backend=backend)
    eager = SiftEngine(model, tokenizer, None, kv_cache_bytes=kv, cuda_graphs=False, backend=backend)
    module = SiftEngine(model, tokenizer, None, kv_cache_bytes=kv, cuda_graphs=False, backend=backend)
    module.runner.fast = None
    fast_path = graphs.runner.fast is not None and eager.runner.fast is not None
    if not fast_path:
        print(f"{name}: the fast decode forward does not serve it: {graphs.runner.fast_refusal}", flush=True)
    t = time.perf_counter()
    graphs.warmup()
    capture_s = time.perf_counter() - t
    rows = []
    eps = torch.finfo(next(model.parameters()).dtype).eps
    for b in BATCHES[:2] if smoke else BATCHES:     # --smoke: the interpreted kernels take seconds a step
        g_logits, g_ids, g_times, syncs = drive(graphs, reqs[:b], steps, check_syncs=True)
        e_logits, e_ids, e_times, _ = drive(eager, reqs[:b], steps, check_syncs=False)
        m_logits, m_ids, m_times, _ = drive(module, reqs[:b], steps, check_syncs=False)
        rel = max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(g_logits, e_logits))
        m_rel, m_steps, m_ok = agreement(g_logits, m_logits, MODULE_TOLERANCE_EPS * eps)
        same = g_ids == e_ids
        ok = same and rel <= TOLERANCE_EPS * eps and syncs == 0 and fast_path and m_ok
        median = lambda ts: 1e3 * sorted(ts)[len(ts) // 2] if ts else None     # noqa: E731
        rows.append(dict(model=name, batch=b, steps=len(g_logits), fast_path=fast_path, ids_equal=same,
                         max_rel_logit_err=rel, tolerance=TOLERANCE_EPS * eps, syncs_in_decode_steps=syncs,
                         module_ids_equal=g_ids == m_ids, module_max_rel_logit_err=m_rel,
                         module_steps_compared=m_steps, module_tolerance=MODULE_TOLERANCE_EPS * eps,
                         module_ok=m_ok, graph_step_ms=median(g_times), eager_step_ms=median(e_times),
                         module_eager_step_ms=median(m_times), capture_s=capture_s, ok=ok))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="decode steps compared per batch")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("check_decode_graph needs a CUDA GPU (or --smoke)")
    steps = 4 if args.smoke else args.steps
    t0 = time.perf_counter()
    model, tokenizer, reqs = llama(args.smoke)
    rows = check("llama-smoke" if args.smoke else "llama-8B-random", model, tokenizer, reqs, steps, args.smoke)
    del model
    if not args.smoke:
        torch.cuda.empty_cache()
        smol = smollm2()
        if smol is not None:
            rows += check("smollm2-135m", *smol, steps, False)
    common.write_result("check-decode-graph", dict(steps=steps, tolerance_eps=TOLERANCE_EPS,
                                                   module_tolerance_eps=MODULE_TOLERANCE_EPS, smoke=args.smoke,
                                                   seconds=time.perf_counter() - t0, rows=rows),
                        common.out_dir(args))
    print(f"\n{'model':<18} {'batch':>5} {'fast':>4} {'ids equal':>9} {'max rel err':>11} {'syncs':>5} "
          f"{'vs module (steps)':>17} {'graph ms':>8} {'eager ms':>8} {'module ms':>9} {'ok':>3}")
    for r in rows:
        print(f"{r['model']:<18} {r['batch']:>5} {'yes' if r['fast_path'] else 'no':>4} {str(r['ids_equal']):>9} "
              f"{r['max_rel_logit_err']:>11.2e} {r['syncs_in_decode_steps']:>5} "
              f"{r['module_max_rel_logit_err']:>11.2e} ({r['module_steps_compared']:>2}) "
              f"{r['graph_step_ms'] or 0:>8.2f} {r['eager_step_ms'] or 0:>8.2f} {r['module_eager_step_ms'] or 0:>9.2f} "
              f"{'yes' if r['ok'] else 'NO':>3}")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    common.run_main(main)
