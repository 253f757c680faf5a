"""A decode step's forward for Llama-structured decoders (Llama, Mistral, Qwen2, SmolLM2, ...) in fewer kernels:
fused projections over the model's own weights and fused element-wise kernels. The runner (runtime/runner.py)
runs it in place of the model's forward where `llama_decode` accepts the model, once per engine.

Per decode step of B rows (one token each), with the residual stream h [B, hidden]:

    h = embed(tokens); x = rms_norm(h, layers[0].input_layernorm); cos, sin = the model's rotary_emb at pos
    per layer:
        q, k, v = rotary_qk(x @ Wqkv^T (+ b), cos, sin)    Wqkv: q_proj, k_proj, v_proj stacked; rotated in place,
                                                            k and v written to the layer's KV pool at each row's slot
        a = attention.attend(layer, q, k, v, scale)         the engine's DecodeAttention (runtime/forward.py)
        x, h = add_rms_norm(o_proj(a), h, post_attention_layernorm)
        m = down_proj(silu_mul(x @ Wgu^T (+ b)))            Wgu: gate_proj, up_proj stacked
        x, h = add_rms_norm(m, h, the next layer's input_layernorm, or the final norm)
    -> x, the final norm's output [B, hidden]

About ten kernels per layer where the module forward launches some thirty (each projection its own GEMM; the
rotary, the residual adds, the SiLU and the multiply as several element-wise kernels each; the KV append two
copies), and the same bytes.
The kernels round where transformers' forward rounds (kernels/rmsnorm.py, kernels/swiglu.py, kernels/rope.py).

Fused weights without a second copy: one stacked matrix per layer for q / k / v and one for gate / up, made once
by concatenation, and the modules' own `weight` (and `bias`) parameters re-pointed to views of its row blocks;
the prefill, which runs the unchanged modules, reads the same memory, and a second engine on the same model finds
the stacked matrices already there.

Which models it serves is decided once, per model: the structure (a decoder layer of exactly these modules, plain
nn.Linear projections, a SiLU, RMSNorms that `rms_norm` computes, no hooks), then the model's own forward on a few
random tokens with the attention replaced by a probe, against this forward layer by layer on the same
activations: the embedding feeds the first layer unscaled, each layer's attention branch and MLP branch match
within a few roundings, the layer adds them to the residual stream as this forward does, and the final norm
follows the last layer. Anything else the model's classes do (a multiplier, a norm in another place, q / k
norms, a parallel residual) fails one of these and the model keeps the module forward.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.device import triton_runs_on
from ..kernels.rmsnorm import add_rms_norm, rms_norm
from ..kernels.rope import rotary_qk
from ..kernels.swiglu import silu_mul

LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# The check's tolerance, in units of the activations' dtype, relative to the largest value of the compared branch:
# the two forwards round the same values in the same dtype, except where another matrix shape makes the GEMM sum
# in another order, and a rounding difference passes through at most five roundings in sequence (projection,
# rotary, o_proj; add + norm, gate / up, SiLU * up, down_proj) before a branch ends. A structural difference moves
# a branch by a sizeable fraction of its size.
CHECK_EPS = 16
CHECK_POSITIONS = (0, 7, 1000)   # the probe tokens' positions (clamped to the model's context)


@dataclasses.dataclass(frozen=True)
class FusedLayer:
    """One decoder layer as the fast forward reads it: the stacked weights (views of which the modules' own
    parameters are), the modules it calls as they are, and the norms' weights and epsilons."""

    index: int
    qkv_weight: torch.Tensor           # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor       # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    o_proj: nn.Module
    down_proj: nn.Module
    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    n_q_heads: int
    n_kv_heads: int
    scale: float


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive row blocks `tensors` are (contiguous, back to back in one storage), or
    None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                            (rows, *first.shape[1:]), first.stride())


def stack_rows(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    """The linears' `name` parameters ("weight" or "bias") stacked along the output rows, in order; afterwards
    each linear's parameter is a view of its row block of the stacked tensor, so no second copy stays. None when
    the linears have no bias. Made once: linears that are already views of one stacked tensor give it back."""
    params = [getattr(m, name) for m in linears]
    if params[0] is None:
        return None
    stacked = _adjacent(params)
    if stacked is not None:
        return stacked
    with torch.no_grad():
        stacked = torch.cat([p.detach() for p in params])
    start = 0
    for m, p in zip(linears, params):
        rows = p.shape[0]
        setattr(m, name, nn.Parameter(stacked[start:start + rows], requires_grad=p.requires_grad))
        start += rows
    return stacked


def refusal(model, norms: list) -> str | None:
    """Why the fast forward cannot serve `model`'s structure, or None. norms: the RMSNorm modules `rms_norm`
    computes exactly (runtime/runner.py `fusable_norms`)."""
    base = model.base_model
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"{type(base).__name__} has no {name!r}"
    if type(base.embed_tokens) is not nn.Embedding:
        return f"embed_tokens is a {type(base.embed_tokens).__name__}, not an nn.Embedding"
    fusable = set(map(id, norms))
    if id(base.norm) not in fusable:
        return f"the final norm ({type(base.norm).__name__}) is not an RMSNorm the kernel computes"
    for m in base.modules():
        if not all(map(inert, [*m._forward_hooks.values(), *m._forward_pre_hooks.values()])):
            return f"{type(m).__name__} has forward hooks, which the fast forward would not call"
        if "forward" in vars(m):
            return f"{type(m).__name__}'s forward is replaced on the instance (an offloading or patching wrapper)"
    for i, layer in enumerate(base.layers):
        where = f"layer {i} ({type(layer).__name__})"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for module, allowed in ((layer, LAYER_CHILDREN), (attn, ATTENTION_CHILDREN), (mlp, MLP_CHILDREN)):
            children = {n for n, _ in module.named_children()} if module is not None else set()
            if children != allowed:
                return f"{where}: {type(module).__name__} has modules {sorted(children)}, not {sorted(allowed)}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if id(norm) not in fusable:
                return f"{where}: {type(norm).__name__} is not an RMSNorm the kernel computes"
        if type(mlp.act_fn) is not nn.SiLU and type(mlp.act_fn).__name__ != "SiLUActivation":
            return f"{where}: the MLP's activation is {type(mlp.act_fn).__name__}, not SiLU"
        linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
            getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in linears):
            return f"{where}: a projection is not a plain nn.Linear (quantised or wrapped)"
        q, k, v, _, gate, up, _ = linears
        if (q.bias is None) != (k.bias is None) or (k.bias is None) != (v.bias is None) or (
                (gate.bias is None) != (up.bias is None)):
            return f"{where}: some of the projections stacked together have a bias and some do not"
        head_dim = getattr(attn, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim % 2 or q.out_features % head_dim or (
                k.out_features != v.out_features or k.out_features % head_dim):
            return f"{where}: q / k / v widths ({q.out_features}, {k.out_features}, {v.out_features}) are not " \
                   f"whole heads of head_dim {head_dim}"
        if not isinstance(getattr(attn, "scaling", None), float):
            return f"{where}: the attention has no float `scaling`"
        if len({p.dtype for p in layer.parameters()}) != 1:
            return f"{where}: its parameters have several dtypes"
    return None


def inert(hook) -> bool:
    """transformers' output-capturing hooks, which it installs on a model's layers the first time a forward asks
    for hidden states or attentions, record only inside such a forward; no decode step is one."""
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


class Probe:
    """Stands in for the engine's attention while the fast forward is checked: a function of each row's own q,
    k, v and the scale (so a wrong head order, rotation, GQA grouping or scale changes the result), the same
    whichever forward calls it."""

    def append_target(self, layer: int) -> None:
        """No KV cache: the fast forward's rotary kernel appends nothing."""
        return None

    def attend(self, layer: int, query, key, value, scale: float, appended: bool = False):
        """query [1, Hq, B, D], key / value [1, Hkv, B, D] -> [1, B, Hq, D]."""
        group = query.shape[1] // key.shape[1]
        kv = (key - 2 * value).repeat_interleave(group, dim=1)
        return (query * scale + kv).transpose(1, 2), None


class LlamaDecode:
    """The fast decode forward of one model (module docstring): `forward(tokens, pos, attention)`."""

    def __init__(self, model):
        base = model.base_model
        self.embed, self.rotary, self.layers_in = base.embed_tokens, base.rotary_emb, base.layers
        self.final_norm = (base.norm.weight, base.norm.variance_epsilon)
        self.layers = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(FusedLayer(
                index=attn.layer_idx if isinstance(getattr(attn, "layer_idx", None), int) else i,
                qkv_weight=stack_rows([attn.q_proj, attn.k_proj, attn.v_proj], "weight"),
                qkv_bias=stack_rows([attn.q_proj, attn.k_proj, attn.v_proj], "bias"),
                gate_up_weight=stack_rows([mlp.gate_proj, mlp.up_proj], "weight"),
                gate_up_bias=stack_rows([mlp.gate_proj, mlp.up_proj], "bias"),
                o_proj=attn.o_proj, down_proj=mlp.down_proj,
                input_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                n_q_heads=attn.q_proj.out_features // attn.head_dim,
                n_kv_heads=attn.k_proj.out_features // attn.head_dim, scale=attn.scaling))

    def rotation(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own cos / sin [B, D] at positions pos [B] (its rope type and scaling included), in h's
        dtype, as its forward computes them."""
        cos, sin = self.rotary(h, pos[None])
        return cos[0], sin[0]

    def attention(self, layer: FusedLayer, x: torch.Tensor, cos, sin, attention) -> torch.Tensor:
        """x [B, hidden] (normed) -> the attention branch o_proj(attend(q, k, v)) [B, hidden]."""
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        # the rotary kernel appends k and v to the KV cache too: two copy kernels fewer per layer
        target = attention.append_target(layer.index)
        q, k, v = rotary_qk(qkv, cos, sin, layer.n_q_heads, layer.n_kv_heads, append_to=target)
        out, _ = attention.attend(layer.index, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  v.transpose(0, 1)[None], layer.scale, appended=target is not None)
        return layer.o_proj(out[0].reshape(x.shape[0], -1))

    def mlp(self, layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] (normed) -> the MLP branch down_proj(silu(gate) * up) [B, hidden]."""
        return layer.down_proj(silu_mul(F.linear(x, layer.gate_up_weight, layer.gate_up_bias)))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, attention) -> torch.Tensor:
        """tokens, pos int64 [B] (each row's input token at its segment-local position), attention: the step's
        DecodeAttention -> the final norm's output [B, hidden]. Launches kernels only (capture-safe)."""
        h = self.embed(tokens)
        cos, sin = self.rotation(h, pos)
        x = rms_norm(h, *self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            x, h = add_rms_norm(self.attention(layer, x, cos, sin, attention), h, *layer.post_norm)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = add_rms_norm(self.mlp(layer, x), h, *following)
        return x

    def mismatch(self, model, routed_attention) -> str | None:
        """The model's own forward of a few random tokens (attention: `Probe`, through the engine's attention
        interface, which `routed_attention()` switches on) against this forward, layer by layer on its
        activations (module docstring) -> what differs, or None."""
        base = model.base_model
        device = self.embed.weight.device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.embed.num_embeddings, (len(CHECK_POSITIONS),), generator=gen).to(device)
        limit = getattr(model.config, "max_position_embeddings", None) or max(CHECK_POSITIONS) + 1
        pos = torch.tensor([min(p, limit - 1) for p in CHECK_POSITIONS], device=device)
        seen: dict[tuple[int, str], torch.Tensor] = {}

        def keep(i: int, what: str):
            def hook(module, args, kwargs, output):
                if what == "layer":
                    seen[i, "in"] = (args[0] if args else kwargs["hidden_states"])[0]
                out = output[0] if isinstance(output, tuple) else output
                seen[i, what] = out[0]
            return hook

        handles = []
        for i, layer in enumerate(self.layers_in):
            for module, what in ((layer, "layer"), (layer.self_attn, "attn"), (layer.mlp, "mlp")):
                handles.append(module.register_forward_hook(keep(i, what), with_kwargs=True))
        probe = Probe()
        try:
            with routed_attention(), torch.no_grad():
                own = base(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                           sift_state=probe).last_hidden_state[0]
        finally:
            for handle in handles:
                handle.remove()
        with torch.no_grad():
            if not torch.equal(seen[0, "in"], self.embed(ids)):
                return "the first layer's input is not the embedding (the model scales or adds to it)"
            cos, sin = self.rotation(seen[0, "in"], pos)
            for i, layer in enumerate(self.layers):
                h = seen[i, "in"].clone()
                attn = self.attention(layer, rms_norm(h, *layer.input_norm), cos, sin, probe)
                x, h = add_rms_norm(attn, h, *layer.post_norm)
                mlp = self.mlp(layer, x)
                for what, fast in (("attention", attn), ("MLP", mlp)):
                    want = seen[i, "attn" if what == "attention" else "mlp"]
                    if not close(fast, want):
                        return f"layer {i}'s {what} branch differs from the module's"
                if not torch.equal(seen[i, "in"] + seen[i, "attn"] + seen[i, "mlp"], seen[i, "layer"]):
                    return f"layer {i} does not add its attention and MLP branches to its input as Llama's does"
            if not close(rms_norm(seen[len(self.layers) - 1, "layer"], *self.final_norm), own):
                return "the model's output is not the final norm of the last layer's"
        return None


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within CHECK_EPS units of the dtype of the largest |want| (the tolerance's reasoning is at CHECK_EPS)."""
    scale = want.float().abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    err = (got.float() - want.float()).abs().max()
    return got.shape == want.shape and bool(err <= CHECK_EPS * torch.finfo(want.dtype).eps * scale)


def llama_decode(model, device: torch.device, norms: list, routed_attention) -> tuple[LlamaDecode | None, str]:
    """The fast decode forward of `model`, or None where it does not apply -> (forward or None, why not: "" when
    it applies). norms: `fusable_norms(model)`; routed_attention: the runner's context manager that routes the
    model's attention to the engine's interface (the check's probe goes through it)."""
    if not triton_runs_on(device):
        return None, f"the Triton kernels do not run on {device}"
    why = refusal(model, norms)
    if why is not None:
        return None, why
    fast = LlamaDecode(model)
    try:
        why = fast.mismatch(model, routed_attention)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError) as e:
        # a model class whose pieces take other arguments (a rotary embedding of another signature, ...)
        why = f"the check against the model's own forward failed: {type(e).__name__}: {e}"
    return (None, why) if why else (fast, "")
