"""The fast decode forward for Llama-structured models (runtime/llama_decode.py) and where the runner uses it
(runtime/runner.py): the engine's decode steps with it against the same steps through the model's own modules
(backend triton, kernels in the interpreter on CPU), the stacked weights as views that leave the model's own
forward unchanged, the real SmolLM2 through every layer, and the models it refuses.

Both decode paths compute in fp32 here and differ only in rounding (one GEMM over stacked weights against three,
the fused element-wise kernels against torch's), so logits compare within `model_logit_tol`: fp32 rounding over
the model's widest dot product and its depth, scaled by the largest logit."""
from __future__ import annotations

import pytest
import torch

from sift.runtime import Request, SamplingParams, SiftEngine
from sift.runtime.llama_decode import Probe
from sift.runtime.runner import ModelRunner

from .helpers import DEVICE, assert_within, model_logit_tol, model_on_device, smollm2
from .test_engine import _tiny

REQUEST = Request("Hi.", [("a", "Lilu is a spirit of the night wind, feared in the marshes of Sumer.")], "Lilu?")


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2()[1]


def decode(engine: SiftEngine, steps: int) -> tuple[list[int], list[torch.Tensor], list[tuple]]:
    """Greedy decode of REQUEST through the step API -> (its tokens, each decode step's fp32 logits [V], each
    decode step's (pool slot, the K and V that step wrote there [n_layers, Hkv, D], read back from the pool))."""
    rid = engine.add_request(REQUEST, SamplingParams(max_tokens=steps + 1, temperature=0.0), mode="dense")
    logits, written, out = [], [], None
    store = engine.kv_store
    while engine.has_unfinished():
        launches = engine.runner.launches
        for o in engine.step():
            out = o
        if engine.runner.launches != launches:
            logits.append(engine.runner.last_logits[0].clone())
            slot = int(engine.runner.batch.slots[0])
            written.append((slot, store.k_pool[:, slot].clone(), store.v_pool[:, slot].clone()))
    assert out.request_id == rid and out.finished
    return out.token_ids, logits, written


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fast_decode_equals_the_module_forward(family, tokenizer, tmp_path):
    """Larger random weights than the default init (std 0.02 makes a tiny model repeat one token), so that the
    greedy tokens change from step to step; qwen2 has q / k / v biases. The KV each step appends to the pool
    (the fast forward's rotary kernel writes it, the module forward's attention copies it) is the same too: the
    rotated keys and the values, at the same slots, within the logits' rounding."""
    model = model_on_device(_tiny(family, tmp_path, initializer_range=0.2))
    fast = SiftEngine(model, tokenizer, None, backend="triton")
    assert fast.runner.fast is not None, fast.runner.fast_refusal
    plain = SiftEngine(model, tokenizer, None, backend="triton")
    plain.runner.fast = None
    a_ids, a_logits, a_kv = decode(fast, 6)
    b_ids, b_logits, b_kv = decode(plain, 6)
    assert a_ids == b_ids and len(set(a_ids)) > 1
    assert len(a_logits) == len(b_logits) == 6
    for step, (a, b) in enumerate(zip(a_logits, b_logits)):
        assert_within(a, b, model_logit_tol(model.config, b), f"{family} step {step}")
    assert len({slot for slot, _, _ in a_kv}) == 6, "each step appends to a slot of its own"
    for step, ((a_slot, a_k, a_v), (b_slot, b_k, b_v)) in enumerate(zip(a_kv, b_kv)):
        assert a_slot == b_slot
        for what, a, b in (("K", a_k, b_k), ("V", a_v, b_v)):
            assert b.abs().amax(dim=(1, 2)).min() > 0, f"step {step}: a layer's {what} row is empty"
            assert_within(a, b, model_logit_tol(model.config, b), f"{family} step {step} pool {what}")


def test_stacked_weights_are_views_and_leave_the_model_unchanged(tokenizer, tmp_path):
    model = model_on_device(_tiny("llama", tmp_path, attention_bias=True, mlp_bias=True))
    ids = torch.tensor([[1, 50, 700, 9000, 42]], device=DEVICE)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(ids).logits
    n_bytes = sum(p.numel() for p in model.parameters())
    engine = SiftEngine(model, tokenizer, None, backend="triton")
    fast = engine.runner.fast
    assert fast is not None, engine.runner.fast_refusal
    for layer, fused in zip(model.model.layers, fast.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for stacked, parts in ((fused.qkv_weight, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
                               (fused.qkv_bias, (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
                               (fused.gate_up_weight, (mlp.gate_proj.weight, mlp.up_proj.weight)),
                               (fused.gate_up_bias, (mlp.gate_proj.bias, mlp.up_proj.bias))):
            assert torch.equal(stacked, torch.cat([p.detach() for p in parts]))
            start = 0
            for p in parts:           # each module's own parameter is its row block of the stacked tensor
                assert p.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                assert p.data_ptr() == stacked.data_ptr() + start * p.element_size()
                start += p.numel()
    assert sum(p.numel() for p in model.parameters()) == n_bytes
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)      # the same values at the same strides: the same GEMMs
    again = SiftEngine(model, tokenizer, None, backend="triton").runner.fast       # finds them, stacks nothing
    for a, b in zip(again.layers, fast.layers):
        assert a.qkv_weight.data_ptr() == b.qkv_weight.data_ptr()
        assert a.gate_up_weight.data_ptr() == b.gate_up_weight.data_ptr()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == fast.layers[0].qkv_weight.untyped_storage().data_ptr()


def test_smollm2_through_every_layer_equals_its_own_forward():
    """The real weights: the fast forward of three tokens (the attention a `Probe`, per row, as in the check)
    against the model's own forward with the same probe, after all 30 layers and the lm_head."""
    model, tokenizer = smollm2()
    model = model_on_device(model)
    engine = SiftEngine(model, tokenizer, None, backend="triton")
    fast = engine.runner.fast
    assert fast is not None, engine.runner.fast_refusal
    ids = torch.tensor(tokenizer("The night wind of Sumer")["input_ids"][:3], device=DEVICE)
    pos = torch.tensor([0, 40, 900], device=DEVICE)
    with torch.no_grad():
        with engine.runner.routed_attention():
            own = model.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                              sift_state=Probe()).last_hidden_state[0]
        want = model.lm_head(own)
        got = model.lm_head(fast.forward(ids, pos, Probe()))
    assert_within(got, want, model_logit_tol(model.config, want), "SmolLM2 fast forward vs its own")
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_models_it_does_not_serve_keep_the_module_forward(tokenizer, tmp_path):
    """Qwen3's q / k norms fail the structure; Granite has Llama's modules but scales the embedding and the
    branches (which moves the MLP's input), which only the check against the model's own forward sees; a user's
    forward hook (but not transformers' own output-capturing hooks); the torch backend and the runner's flag."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    qwen3 = SiftEngine(model_on_device(_tiny("qwen3", tmp_path / "q")), tokenizer, None, backend="triton").runner
    assert qwen3.fast is None and "q_norm" in qwen3.fast_refusal
    kwargs = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    for overrides, why in (({"embedding_multiplier": 2.0}, "not the embedding"),
                           ({"residual_multiplier": 0.5}, "MLP branch differs")):
        torch.manual_seed(0)
        granite = AutoModelForCausalLM.from_config(GraniteConfig(**kwargs, **overrides)).eval().to(DEVICE)
        runner = SiftEngine(granite, tokenizer, None, backend="triton").runner
        assert runner.fast is None and why in runner.fast_refusal, runner.fast_refusal
    model = model_on_device(_tiny("llama", tmp_path / "l"))
    assert SiftEngine(model, tokenizer, None, backend="torch").runner.fast is None
    hook = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: None)
    runner = SiftEngine(model, tokenizer, None, backend="triton").runner
    assert runner.fast is None and "forward hooks" in runner.fast_refusal
    hook.remove()
    with torch.no_grad():   # transformers installs its (inactive) output-capturing hooks on the layers, for good
        model(torch.tensor([[1, 2, 3]], device=DEVICE), output_hidden_states=True)
    assert any(layer._forward_hooks for layer in model.model.layers)
    runner = SiftEngine(model, tokenizer, None, backend="triton").runner
    assert runner.fast is not None, runner.fast_refusal
    engine = SiftEngine(model, tokenizer, None, backend="triton")
    off = ModelRunner(model, engine.attention_backend, engine.inv_freq, engine.kv_store, block=engine.block,
                      max_positions=4096, cuda_graphs=False, fast_decode=False)
    assert off.fast is None and off.fast_refusal == "fast_decode=False"
