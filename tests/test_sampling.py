"""The sampler (runtime/sampling.py) against references written from the definitions (transformers' semantics):
the support top-k / top-p keep, exact sampling from the kept distribution (a bounded chi-square), reproducibility
of a seeded request, and SamplingParams' validation. Engine-level sampling is in tests/test_step_api.py."""
import math

import pytest
import torch

from sift.errors import SiftError
from sift.runtime import SamplingParams
from sift.runtime.sampling import kept_mask, sample, seed_key, vocab_hash


def reference_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """bool [V]: scale by the temperature; top-k keeps the tokens whose scaled logit is at least the k-th largest
    (ties kept; all of them when k exceeds the vocabulary); top-p then keeps, among those, the most probable
    tokens (renormalised, in decreasing probability, ties by token id) up to and including the first at which
    their cumulative probability reaches top_p."""
    scaled = [float(x) / temperature for x in logits]
    keep = [True] * len(scaled)
    if top_k:
        kth = sorted(scaled, reverse=True)[min(top_k, len(scaled)) - 1]   # k beyond the vocabulary: all
        keep = [x >= kth for x in scaled]
    if top_p < 1.0:
        m = max(scaled)
        weights = [math.exp(x - m) if k else 0.0 for x, k in zip(scaled, keep)]
        total = sum(weights)
        order = sorted(range(len(scaled)), key=lambda i: (-weights[i], i))
        keep, cum = [False] * len(scaled), 0.0
        for i in order:
            if weights[i] == 0.0 or cum >= top_p:
                break
            keep[i] = True
            cum += weights[i] / total
    return torch.tensor(keep)


def rows(n: int, temperature: float, top_k: int, top_p: float):
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64), torch.full((n,), top_p))


# Logits with ties (at the top, inside the top-k cut and below it) and well-separated cumulative probabilities.
LOGITS = torch.tensor([2.0, 0.5, 3.1, 2.0, -1.0, 0.5, 1.2, 3.1, -0.3, 0.5, 2.6, -2.0, 0.9, 1.7, 0.5, -0.7])
CASES = [(1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 4, 1.0), (1.0, 6, 1.0), (0.7, 0, 0.5), (1.3, 0, 0.8), (1.0, 0, 0.95),
         (0.9, 7, 0.6), (2.0, 10, 0.9), (1.0, 1, 1.0), (1.0, 100, 0.3), (0.5, 0, 0.01)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_kept_support_equals_the_definitions(temperature, top_k, top_p):
    got = kept_mask(LOGITS[None], *rows(1, temperature, top_k, top_p))[0]
    want = reference_support(LOGITS, temperature, top_k, top_p)
    print(f"T={temperature} k={top_k} p={top_p}: kept {want.nonzero().flatten().tolist()}")
    assert torch.equal(got, want)


def test_batch_rows_keep_their_own_support():
    """Each row filters with its own parameters in one call."""
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.3])
    params = [(1.0, 3, 1.0), (0.8, 0, 0.7), (1.5, 5, 0.9)]
    t, k, p = (torch.tensor(x) for x in zip(*params))
    got = kept_mask(logits, t.float(), k.long(), p.float())
    for row, (temperature, top_k, top_p) in enumerate(params):
        assert torch.equal(got[row], reference_support(logits[row], temperature, top_k, top_p))


def chi2_bound(df: int, z: float = 4.75) -> float:
    """The chi-square quantile at the normal's z (4.75: one in a million), Wilson-Hilferty's approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)])
def test_samples_follow_the_kept_distribution(temperature, top_k, top_p):
    """20,000 draws (one request, counters 0..N-1: what a long generation draws) land only in the kept support,
    with frequencies the kept, renormalised softmax predicts (chi-square below its one-in-a-million quantile)."""
    logits = LOGITS[:8]
    n = 20_000
    want = reference_support(logits, temperature, top_k, top_p)
    probs = torch.softmax((logits / temperature).masked_fill(~want, float("-inf")).double(), dim=0)
    t, k, p = rows(n, temperature, top_k, top_p)
    drawn = sample(logits.expand(n, -1), t, k, p, torch.full((n,), seed_key(11)), torch.arange(n),
                   vocab_hash(8, "cpu"))
    counts = torch.bincount(drawn, minlength=8).double()
    assert counts[~want].sum() == 0
    expected = probs[want] * n
    stat = float(((counts[want] - expected) ** 2 / expected).sum())
    df = int(want.sum()) - 1
    print(f"kept {int(want.sum())}: chi-square {stat:.1f} (bound {chi2_bound(max(df, 1)):.1f})")
    if df:
        assert stat < chi2_bound(df)


def test_seeded_draws_are_reproducible_and_seeds_differ():
    """A draw depends on (seed, token index, vocabulary id) only: the same in any batch row, another with
    another seed or index."""
    vocab = 1000
    logits = torch.zeros(4, vocab)
    t, k, p = rows(4, 1.0, 0, 1.0)
    keys = torch.tensor([seed_key(1), seed_key(1), seed_key(2), seed_key(1)])
    counters = torch.tensor([5, 5, 5, 6])
    a = sample(logits, t, k, p, keys, counters, vocab_hash(vocab, "cpu"))
    b = sample(logits[:1], t[:1], k[:1], p[:1], keys[:1], counters[:1], vocab_hash(vocab, "cpu"))
    assert a[0] == a[1] == b[0]
    assert a[2] != a[0] and a[3] != a[0]


def test_greedy_rows_take_the_first_maximum():
    logits = torch.stack([LOGITS, LOGITS])
    t = torch.tensor([0.0, 0.0])
    got = sample(logits, t, torch.tensor([2, 0]), torch.tensor([0.5, 1.0]), torch.tensor([1, 2]),
                 torch.tensor([0, 0]), vocab_hash(16, "cpu"))
    assert got.tolist() == [2, 2]      # 3.1 at ids 2 and 7: the first
    assert sample(logits, t, torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                  torch.zeros(2, dtype=torch.int64), vocab_hash(16, "cpu"), greedy_only=True).tolist() == [2, 2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature=-0.1"), (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"), (dict(max_tokens=0), "max_tokens=0"),
    (dict(max_tokens=True), "max_tokens=True"), (dict(max_tokens=2.0), "max_tokens=2.0"),
    (dict(top_k=-1), "top_k=-1"), (dict(seed="x"), "seed='x'"), (dict(stop=[""]), "stop="),
    (dict(stop=[3]), "stop="), (dict(stop_token_ids=[-1]), "stop_token_ids="),
    (dict(stop_token_ids=list(range(40))), "stop_token_ids="), (dict(temperature="hot"), "temperature='hot'"),
])
def test_bad_sampling_params_are_refused_in_one_line(kwargs, match):
    with pytest.raises(SiftError, match=match) as e:
        SamplingParams(**kwargs)
    assert "\n" not in str(e.value)


def test_sampling_params_normalise():
    p = SamplingParams(max_tokens=4, temperature=0, top_k=0, stop="\n\n", stop_token_ids=[7, 8], seed=3)
    assert p.greedy and p.top_k is None and p.stop == ("\n\n",) and p.stop_token_ids == (7, 8)
    assert isinstance(p.temperature, float) and SamplingParams().temperature == 1.0
