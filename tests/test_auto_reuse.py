"""Mode "auto" and the builder's context sensitivity (pipeline/sensitivity.py), on CPU with the real SmolLM2.

The sensitivity's expected value is computed from its definition with the model's own k_proj outputs captured by
forward hooks during plain forwards (the function under test recomputes keys from the hidden states instead).
Mode "auto"'s choice is checked against `reuse.auto_budget`'s rule worked out by hand for the request's block
counts, and a call that recomputes nothing must run reuse's forward exactly (bitwise equal logits).
"""
import math

import pytest
import torch

from sift.errors import SiftError
from sift.pipeline.sensitivity import context_sensitivity, default_context_ids
from sift.runtime import KVStore, SiftEngine
from sift.runtime.modes import Mode
from sift.runtime.reuse import auto_budget

from .helpers import assert_within, model_logit_tol, model_rounding
from .test_engine import doc_ids, hotpot, real, write_index  # noqa: F401 (fixture)
from .test_kv_reuse import requests_of


@torch.inference_mode()
def hooked_keys(model, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's k_proj output [n, Hkv * D] of a plain forward of `ids`, captured by hooks."""
    keys, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: keys.append(o[0].double())))
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return keys


def test_sensitivity_matches_its_definition(real):
    model, tokenizer, _ = real
    prefix = [tokenizer.bos_token_id]
    doc = tokenizer("The bridge was closed in 1998 after the flood; it reopened two years later.",
                    add_special_tokens=False).input_ids
    context = default_context_ids(tokenizer, 48)
    alone = hooked_keys(model, prefix + doc)
    ctx = hooked_keys(model, prefix + context + doc)
    n = len(doc)
    ratios = [float(((c[-n:] - a[-n:]) ** 2).sum() / (a[-n:] ** 2).sum()) for a, c in zip(alone[1:], ctx[1:])]
    want = sum(ratios) / len(ratios)
    got = context_sensitivity(model, prefix, doc, context)
    # both sides are fp32 forwards of the same prompts in other shapes: relative rounding of the model's depth
    tol = 4 * model_rounding(model.config) * want
    print(f"sensitivity {got:.6f}, reference {want:.6f} (tolerance {tol:.1e})")
    assert want > 0 and abs(got - want) <= tol
    assert context_sensitivity(model, prefix, [], context) == 0.0


def test_auto_budget_rule():
    # budget ceil(0.3 * 30) = 9 blocks: never the first document, highest score first, ties to the earlier
    assert auto_budget([10, 10, 10], [0.9, 0.2, 0.3], 0.3, 0.0) == [0, 0, 9]
    assert auto_budget([10, 4, 10], [None, 0.5, 0.5], 0.5, 0.0) == [0, 4, 8]     # 12 blocks: a tie, the earlier first
    assert auto_budget([10, 10, 10], [0.9, 0.2, 0.3], 0.3, 0.25) == [0, 0, 9]
    assert auto_budget([10, 10, 10], [0.9, 0.2, 0.3], 0.3, 0.5) == [0, 0, 0]
    assert auto_budget([10, 10, 10], [None, None, None], 0.3, 0.01) == [0, 0, 0]
    assert auto_budget([7], [1.0], 1.0, 0.0) == [0]


def test_auto_mode_parsing():
    m = Mode.parse("auto@0.25:0.1")
    assert (m.kind, m.fraction, m.threshold, m.reuses) == ("auto", 0.25, 0.1, True)
    assert Mode.parse("auto").fraction == 0.3
    for bad in ("auto@", "auto@1.5", "auto@0.3:-1", "auto@0.3:x", "auto:first"):
        with pytest.raises(SiftError) as e:
            Mode.parse(bad)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def engine(real, tmp_path_factory):
    model, tokenizer, fp = real
    q = hotpot(1)[0]
    req = requests_of(q, [0, 1, 2])
    ids = doc_ids(tokenizer, [req])
    scores = dict(zip([d for d, _ in req.docs], [0.9, 0.2, 0.4]))
    index = write_index(tmp_path_factory.mktemp("auto") / "index", model, fp, ids, tile=16,
                        prefix_ids=[tokenizer.bos_token_id], sensitivity=scores)
    cfg = model.config
    page = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16 * index.head_dim * 4
    return SiftEngine(model, tokenizer, index, kv_store=KVStore(hbm_bytes=96 * page)), req, ids


def test_auto_recomputes_the_most_sensitive_documents_within_budget(engine):
    eng, req, ids = engine
    lengths = [len(ids[d]) for d, _ in req.docs]
    blocks = [math.ceil(n / 16) for n in lengths]
    budget = math.ceil(0.3 * sum(blocks))
    # by hand: the first document is never recomputed; the third (0.4) takes the budget before the second (0.2)
    third = min(blocks[2], budget)
    second = min(blocks[1], budget - third)
    tokens = sum(min(16, lengths[2] - 16 * b) for b in range(third)) + \
        sum(min(16, lengths[1] - 16 * b) for b in range(second))
    out = eng.prefill([req], mode="auto@0.3:0")
    assert out.recomputed_fraction == pytest.approx(tokens / sum(lengths))
    only_third = eng.prefill([req], mode="auto@0.3:0.3")          # the second is below the threshold
    assert only_third.recomputed_fraction == pytest.approx(
        sum(min(16, lengths[2] - 16 * b) for b in range(third)) / sum(lengths))
    none = eng.prefill([req], mode="auto@0.3:0.95")                 # no document qualifies: reuse's forward
    reuse = eng.prefill([req], mode="reuse")
    assert none.recomputed_fraction == 0.0 and torch.equal(none.logits, reuse.logits)


def test_ape_mode_rescales_reused_documents(engine):
    """T = S = 1 is reuse (other arithmetic, same values); T < 1 changes what the query reads, in the prefill and
    in every decode step (the rows' decode tables carry which entries are reused documents)."""
    eng, req, _ = engine
    reuse = eng.generate([req], 3, mode="reuse")
    plain = eng.generate([req], 3, mode="ape@1:1")
    assert_within(plain.prefill.logits, reuse.prefill.logits, model_logit_tol(eng.model.config, reuse.prefill.logits),
                  "ape@1:1 against reuse")
    sharp = eng.prefill([req], mode="ape@0.5:1")
    assert (sharp.logits - reuse.prefill.logits).abs().max() > 100 * model_logit_tol(eng.model.config,
                                                                                       reuse.prefill.logits)
    assert sharp.recomputed_fraction == 0.0
