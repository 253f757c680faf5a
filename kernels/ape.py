"""Attention rescaling of parallel-encoded context (APE, Yang et al., ICLR 2025), the torch reference of the
attention kernels' `ape` option.

A reused document was encoded on its own (after the shared profiling prefix), not after the documents that
precede it in a request: its keys never competed with theirs, so a query's attention to it is flatter and its
share of the total differs from what a sequential prefill gives. APE corrects both at query time, training-free.
For one query row with scaled scores s_j (q . k_j * scale), the keys split into P (blocks of parallel-encoded
context: document blocks read from the KV store) and O (every other key: the prefix, recomputed blocks, the
query's own), and with a temperature T and a scale S:

    lse_O = log sum_{j in O} exp(s_j)           o_O = sum_{j in O} softmax_O(s)_j v_j
    lse_P = log sum_{j in P} exp(s_j / T)       o_P = sum_{j in P} softmax_P(s / T)_j v_j
    out   = (exp(S * T * lse_P) o_P + exp(lse_O) o_O) / (exp(S * T * lse_P) + exp(lse_O))

T < 1 sharpens the attention inside the context; S * T rescales the context's log-mass (T * lse_P tracks lse of
the unsharpened scores, so S alone moves the share the context gets). T = S = 1 is plain softmax attention; a
row with no key in P is plain softmax attention over O whatever T and S.
"""
from __future__ import annotations

import math

import torch


def check_ape(ape) -> tuple[float, float]:
    """`ape` as the kernels take it: (temperature, scale), both positive finite floats -> the pair."""
    if (not isinstance(ape, (tuple, list)) or len(ape) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x and math.isfinite(x)
                       for x in ape)):
        raise ValueError(f"ape={ape!r} must be (temperature, scale), two positive finite floats")
    return float(ape[0]), float(ape[1])


def ape_probs(s: torch.Tensor, parallel: torch.Tensor, temperature: float, scale: float) -> torch.Tensor:
    """Attention weights of the module docstring's rule: fp32 [..., n] from scaled scores s [..., n] (masked keys
    at -inf) and parallel: bool, broadcastable to s (True: the key is parallel-encoded context); out = p @ v.
    A row that sees no key is all 0."""
    s = s.float()
    neg = torch.tensor(float("-inf"), device=s.device)
    s_o = torch.where(parallel, neg, s)
    s_p = torch.where(parallel, s / temperature, neg)
    lse_o = torch.logsumexp(s_o, dim=-1, keepdim=True)
    lse_p = torch.logsumexp(s_p, dim=-1, keepdim=True)
    mass_p = scale * temperature * lse_p
    total = torch.logaddexp(lse_o, mass_p)
    # -inf - -inf is NaN: a row without keys in a part gets 0 from that part (and 0 from both if it sees none)
    p_o = torch.exp(s_o - total).nan_to_num(0.0)
    p_p = (torch.exp(mass_p - total) * torch.exp(s_p - lse_p)).nan_to_num(0.0)
    return p_o + p_p
