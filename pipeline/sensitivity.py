"""A document's context sensitivity: how much its keys move when it follows another document instead of being
encoded on its own, the builder's per-document signal for KV reuse (SPEC section 3, column
`context_sensitivity`; mode "auto" of runtime/reuse.py recomputes the most sensitive documents of a request).

A reused document's KV was computed after the profiling prefix only. In a request it follows other documents,
and a prefill over the whole prompt would have given its tokens other keys and values from layer 1 on. Some
documents barely move (self-contained text: their tokens attend to themselves and the sink), others move a lot
(text that continues something, lists, tables, pronouns). The score, from the definition:

    K_alone[l]   the document's keys at layer l, encoded as [profiling prefix, document]
    K_ctx[l]     the same tokens' keys encoded as [profiling prefix, context, document]
    score        = mean over layers l >= 1 of  ||K_ctx[l] - K_alone[l]||^2 / ||K_alone[l]||^2

over the document's tokens and every kv head, with keys taken before RoPE (position-free: a segment's keys
differ from the stored ones only through what precedes it, never through where it sits). Layer 0's keys depend
on the token alone, so it is left out. `context` is a fixed text (`default_context_ids`: the shipped sample
corpus's Wikipedia leads), so the score is a property of the document, the same in every build.

Cost: two forwards of the document (one could share the profiling forward when the builder calls it there).
"""
from __future__ import annotations

import json

import torch

from .corpus import SAMPLE_CORPUS

CONTEXT_TOKENS = 256


def default_context_ids(tokenizer, n_tokens: int = CONTEXT_TOKENS) -> list[int]:
    """The fixed preceding document: the shipped sample corpus's Wikipedia leads, from the end of the file (the
    oracle's reader reads it from the start), cut at n_tokens tokens."""
    ids: list[int] = []
    lines = (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text().splitlines()
    for line in reversed(lines):
        ids += tokenizer(json.loads(line)["text"] + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def _layer_keys(model, ids: list[int], first: int) -> list[torch.Tensor]:
    """Pre-RoPE keys of tokens ids[first:] at every layer: fp32 [n, Hkv * D] per layer (the layer's input norm,
    k_proj and, where the model has one, its k_norm)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    hidden = model.base_model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
    keys = []
    for layer, h in zip(model.base_model.layers, hidden):
        attn = layer.self_attn
        k = attn.k_proj(layer.input_layernorm(h[0, first:]))
        if getattr(attn, "k_norm", None) is not None:      # Qwen3 normalises each head's keys
            k = attn.k_norm(k.view(k.shape[0], -1, attn.head_dim)).flatten(1)
        keys.append(k.float())
    return keys


@torch.inference_mode()
def context_sensitivity(model, prefix_ids: list[int], doc_ids: list[int], context_ids: list[int]) -> float:
    """The score of the module docstring for one document (token ids without special tokens) after the profiling
    prefix `prefix_ids`, against the preceding text `context_ids`. An empty document scores 0."""
    if not doc_ids:
        return 0.0
    alone = _layer_keys(model, list(prefix_ids) + list(doc_ids), len(prefix_ids))
    ctx = _layer_keys(model, list(prefix_ids) + list(context_ids) + list(doc_ids),
                      len(prefix_ids) + len(context_ids))
    ratios = [float(((c - a) ** 2).sum() / (a ** 2).sum().clamp_min(1e-30)) for a, c in zip(alone[1:], ctx[1:])]
    return sum(ratios) / len(ratios) if ratios else 0.0
