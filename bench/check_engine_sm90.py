"""H200 check that `SiftEngine` drives the Gluon Hopper kernel end to end, in prefill and in generation.

A random Llama-shaped model with head_dim 128 (so the prefill takes `sparse_attention_sm90` on sm_90; 4 layers,
hidden 1024, 8 query / 2 KV heads, bf16, built from a config, no download), three requests of ~1.2K tokens each
(three documents of random token ids and a query), dense mode (all blocks listed, no index needed). The engine's
`prefill` and `generate` (whose prefill cache keeps room for the generated tokens: K / V are the first slots of
longer buffers) run once as shipped and once with the Gluon kernel refused (the tl kernel, checked against the
torch twin in CI): last-position logits and greedy ids must agree, and the Gluon launches are counted, so a silent
fallback fails the check. The cosine to the unchanged model's own forward is printed for scale (random weights
give nearly flat logits: greedy ids against transformers' `generate` are not a usable check). Writes
$OUT/check_engine.json when OUT is set.

    source bench/device_env.sh && timeout 300 python3 bench/check_engine_sm90.py
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import use_checkout  # noqa: E402

use_checkout()
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench_ttft import IdTokenizer  # noqa: E402  (text = token ids as decimal numbers)
from sift.kernels import sparse_attention_sm90 as sm90  # noqa: E402
from sift.runtime import Request, SiftEngine  # noqa: E402

NEW_TOKENS = 8


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, vocab_size=2048, max_position_embeddings=8192,
                      rope_theta=500000.0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)

    def text(n: int) -> str:
        return " ".join(str(t) for t in torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist())

    reqs = [Request(prefix="", docs=[(f"d{r}{i}", text(n)) for i, n in enumerate((300 + 37 * r, 411, 290))],
                    query=text(150 + r)) for r in range(3)]
    engine = SiftEngine(model, IdTokenizer(1, 2), None)
    calls = {"n": 0}
    launch, supports = sm90.launch, sm90.supports

    def counted(*a, **kw):
        calls["n"] += 1
        return launch(*a, **kw)

    def run(gluon: bool):
        """prefill logits, generated ids and Gluon launches of each, with the Gluon kernel or the tl kernel."""
        sm90.launch = counted
        sm90.supports = supports if gluon else (lambda *a, **kw: False)
        try:
            calls["n"] = 0
            res = engine.prefill(reqs, mode="dense")
            n_pre = calls["n"]
            calls["n"] = 0
            out = engine.generate(reqs, max_new_tokens=NEW_TOKENS, mode="dense")
            return res.logits, out.token_ids, n_pre, calls["n"]
        finally:
            sm90.launch, sm90.supports = launch, supports

    ok, rows = True, {}
    n_layers = cfg.num_hidden_layers
    with torch.inference_mode():
        logits_g, ids_g, pre_g, gen_g = run(gluon=True)
        logits_t, ids_t, pre_t, gen_t = run(gluon=False)
        rows.update(gluon_launches_prefill=pre_g, gluon_launches_generate=gen_g, tl_run_gluon_launches=pre_t + gen_t)
        ok &= pre_g == n_layers and gen_g == n_layers and pre_t + gen_t == 0
        print(f"Gluon launches: prefill {pre_g}, generate {gen_g} (expected {n_layers} each); with the Gluon kernel "
              f"refused: {pre_t + gen_t}", flush=True)
        for i, r in enumerate(reqs):
            ids = engine.prompt_ids(r)
            plain = model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].float()
            rel = ((logits_g[i] - logits_t[i]).norm() / logits_t[i].norm()).item()
            cos = torch.nn.functional.cosine_similarity(logits_g[i], plain, dim=0).item()
            same = list(ids_g[i]) == list(ids_t[i])
            rows[f"request{i}"] = dict(n_tokens=len(ids), gluon_vs_tl_logits_rel=round(rel, 6),
                                       gluon_vs_plain_forward_cosine=round(cos, 5), tokens_gluon=list(ids_g[i]),
                                       tokens_tl=list(ids_t[i]), equal=same)
            ok &= rel < 1e-2 and same
            print(f"request {i}: {len(ids)} tokens, logits Gluon vs tl kernel rel {rel:.2e} (vs the plain model's "
                  f"forward: cosine {cos:.4f}), generated ids equal: {same}", flush=True)
    print("ALL OK" if ok else "SOME FAILED", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_engine.json"), "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), ok=ok, **rows), fh, indent=1)


if __name__ == "__main__":
    main()
