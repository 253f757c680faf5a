"""Check that `SiftEngine` drives the Gluon Hopper kernel end to end, in prefill and in generation, and that its
logits are as close to an fp32 reference as the bf16 ref twins' -> bench/results/check-engine-sm90.json.

A random Llama-shaped model with head_dim 128 (so the prefill takes the Gluon kernel on sm_90; 4 layers, hidden
1024, 8 query / 2 KV heads, built from a config, no download), three requests of ~1.2K tokens each (three
documents of random token ids and a query), dense mode (every causal block listed, no index needed). `prefill`
and `generate` (the prompt's K / V in pages of the engine's pool, read through the page of each block) run four
times over the same weights:

    gluon   bf16, backend "triton" as shipped: the Gluon kernel (its launches are counted, so a silent fallback
            to the tl kernel fails the check)
    tl      bf16, backend "triton" with the Gluon kernel refused: the portable tl kernel
    twin    bf16, backend "torch": the kernels' ref twins, attention computed in fp32 from the bf16 inputs
    fp32    the same (bf16-rounded) weights in float32, backend "torch": the reference

Pass (bench/common.py `check_within_twin`): the kernels' last-position logits are within FACTOR times the twin's
own error of the reference (relative L2 per request), and their greedy ids equal the reference's up to the first
step whose top-2 margin in the reference is not clear of that error. Exit status 1 after writing the result if a
check fails.

    python bench/check_engine_sm90.py            # an sm_90 GPU
    python bench/check_engine_sm90.py --smoke    # a tiny model on CPU: backend "reference" as the kernel under test
"""
from __future__ import annotations

import contextlib
import copy
import sys

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sift.runtime import Request, SiftEngine  # noqa: E402

# The kernels and the twin run the same bf16 model, so most of their error against the fp32 reference is the
# rounding they share: bf16 weights products, activations and the K / V they store. What the kernels add on top
# is their own attention rounding, where the twin attends in fp32: P rounded to bf16 before the P V product, and
# the query tile rotated in packed bf16 (cos / sin rounded to bf16 and two roundings per element, relative error
# ~2e-3 per element against ~1.4e-3 for an fp32 rotation). That is of the order of the bf16 inputs' own rounding,
# so a correct kernel stays within twice the twin's error; a wrong rotation, block or mask errs by O(1).
FACTOR = 2.0
# Two logits whose reference gap is below this many times the twin's largest logit error may swap order in a
# correct bf16 run (each may move by up to FACTOR x that error, in opposite directions); greedy ids are compared
# only up to the first such step.
MARGIN_ERRORS = 2 * FACTOR
NEW_TOKENS = 8


def model_config(smoke: bool) -> LlamaConfig:
    if smoke:  # head_dim 64, the smallest the kernels take
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
                           rope_theta=500000.0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=128, vocab_size=2048, max_position_embeddings=8192,
                       rope_theta=500000.0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")


def make_requests(cfg: LlamaConfig, smoke: bool) -> list[Request]:
    """Three requests of three random-token documents and a query (lengths not multiples of the block)."""
    gen = torch.Generator().manual_seed(1)
    scale = 8 if smoke else 1

    def text(n: int) -> str:
        return " ".join(str(t) for t in torch.randint(3, cfg.vocab_size, (max(1, n // scale),), generator=gen).tolist())

    return [Request(prefix="", docs=[(f"d{r}{i}", text(n)) for i, n in enumerate((300 + 37 * r, 411, 290))],
                    query=text(150 + r)) for r in range(3)]


@contextlib.contextmanager
def gluon_kernel(allowed: bool, launches: list[int]):
    """Count the Gluon kernel's launches into launches[0]; allowed=False makes it refuse every call, so the
    dispatcher takes the tl kernel."""
    from sift.kernels import sparse_attention_sm90 as sm90

    launch, supports = sm90.launch, sm90.supports

    def counted(*a, **kw):
        launches[0] += 1
        return launch(*a, **kw)

    sm90.launch = counted
    sm90.supports = supports if allowed else (lambda *a, **kw: False)
    try:
        yield
    finally:
        sm90.launch, sm90.supports = launch, supports


def run(model, backend: str, reqs: list[Request], *, gluon: bool = True) -> dict:
    """Prefill logits [R, V] (fp32) and greedy ids of one engine, and on CUDA the Gluon launches of each call
    (gluon=False: the Gluon kernel refuses every call)."""
    engine = SiftEngine(model, IdTokenizer(1, 2), None, backend=backend)
    launches = [0]
    hook = gluon_kernel(gluon, launches) if model.device.type == "cuda" else contextlib.nullcontext()
    with hook:
        logits = engine.prefill(reqs, mode="dense").logits.float()
        n_prefill, launches[0] = launches[0], 0
        ids = engine.generate(reqs, max_new_tokens=NEW_TOKENS, mode="dense").token_ids
    return dict(engine=engine, logits=logits, ids=[list(x) for x in ids], launches=(n_prefill, launches[0]))


@torch.inference_mode()
def reference_margins(model32, engine: SiftEngine, reqs: list[Request], ref_ids: list[list[int]]) -> list[list[float]]:
    """Top-2 gap of the fp32 model's logits at each generated step (teacher-forced on the reference's own ids:
    a plain transformers forward, which the engine's dense mode equals, SPEC section 4)."""
    margins = []
    for req, ids in zip(reqs, ref_ids):
        prompt = engine.prompt_ids(req)
        x = torch.tensor([prompt + ids[:-1]], device=model32.device)
        logits = model32(input_ids=x).logits[0, len(prompt) - 1:].float()
        top2 = logits.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return margins


def ids_agree(ids: list[int], ref: list[int], margins: list[float], min_margin: float) -> tuple[bool, int]:
    """Equal to the reference at every step up to the first one whose reference margin is not clear;
    -> (agree, steps compared)."""
    for t, (a, b, m) in enumerate(zip(ids, ref, margins)):
        if m < min_margin:
            return True, t
        if a != b:
            return False, t + 1
    return len(ids) == len(ref), min(len(ids), len(ref))


def check(checks: common.Checks, name: str, res: dict, twin: dict, ref: dict, margins, twin_abs: float,
          depth: int) -> dict:
    """One kernel's logits and ids against the reference, per request."""
    rows = []
    for i in range(len(ref["ids"])):
        logits = common.check_within_twin(f"{name}/request{i}/logits", res["logits"][i], twin["logits"][i],
                                          ref["logits"][i], factor=FACTOR, ref_dtype=torch.float32, depth=depth)
        checks.add(logits)
        err, err_twin = logits.value, common.relative_error(twin["logits"][i], ref["logits"][i])
        same, compared = ids_agree(res["ids"][i], ref["ids"][i], margins[i], MARGIN_ERRORS * twin_abs)
        checks.true(f"{name}/request{i}/greedy_ids", same, f"equal to the reference's on {compared} clear steps")
        good = logits.ok and same
        all_equal = res["ids"][i] == ref["ids"][i]  # for information: beyond an unclear step either may be right
        rows.append(dict(rel_err=err, twin_rel_err=err_twin, ratio=err / max(err_twin, 1e-30),
                         ids=res["ids"][i], ids_compared=compared, ids_agree=same, ids_all_equal=all_equal, ok=good))
        print(f"{name} request {i}: logits rel err {err:.2e} vs the twin's {err_twin:.2e} "
              f"({err / max(err_twin, 1e-30):.2f}x, limit {FACTOR:g}x); ids agree on {compared} clear steps: {same} "
              f"(all {len(ref['ids'][i])} equal: {all_equal})", flush=True)
    return dict(requests=rows, launches=res["launches"])


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("check_engine_sm90 needs a CUDA GPU (sm_90 for the Gluon kernel), or --smoke")
    device = "cpu" if args.smoke else "cuda"
    cfg = model_config(args.smoke)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    model32 = copy.deepcopy(model).float()  # the same weights, rounded to bf16 once: only the compute differs
    reqs = make_requests(cfg, args.smoke)

    ref = run(model32, "torch", reqs)
    twin = run(model, "torch", reqs)
    under_test = {"reference": run(model, "reference", reqs)} if args.smoke else \
        {"gluon": run(model, "triton", reqs), "tl": run(model, "triton", reqs, gluon=False)}
    margins = reference_margins(model32, ref["engine"], reqs, ref["ids"])
    twin_abs = max(float((twin["logits"][i] - ref["logits"][i]).abs().max()) for i in range(len(reqs)))

    checks, result = common.Checks(), {}
    for name, res in under_test.items():
        result[name] = check(checks, name, res, twin, ref, margins, twin_abs, depth=cfg.num_hidden_layers)
    if not args.smoke:
        n = cfg.num_hidden_layers
        gluon, tl = under_test["gluon"]["launches"], under_test["tl"]["launches"]
        checks.true("gluon_launches", gluon == (n, n) and tl == (0, 0),
                    f"prefill {gluon[0]}, generate {gluon[1]} (expected {n} each); with the Gluon kernel refused: "
                    f"{sum(tl)} (expected 0)")
    result.update(reference=dict(ids=ref["ids"], margins=margins), twin=dict(ids=twin["ids"]),
                  twin_max_abs_logit_err=twin_abs, factor=FACTOR, min_margin=MARGIN_ERRORS * twin_abs,
                  model=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                             kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim),
                  n_tokens=[len(ref["engine"].prompt_ids(r)) for r in reqs], new_tokens=NEW_TOKENS, smoke=args.smoke,
                  checks=checks.to_json(), ok=checks.ok)
    common.write_result("check-engine-sm90", result, common.out_dir(args))
    sys.exit(checks.exit_status())


if __name__ == "__main__":
    main()
