"""Bit-exactness of the builder's CPU profiling against a brute-force reference written here from SPEC
section 2: materialise A with the model's own eager attention (output_attentions), apply the thresholds cell
by cell, pack MSB-first by hand. Real SmolLM2 weights, real Wikipedia text.
"""
import numpy as np
import pytest
import torch

from sift.pipeline.config import ProfileConfig
from sift.pipeline.profiler import Profiler, profiling_prefix_ids

from .helpers import model_rounding, smollm2, wiki_texts


def brute_force_bits(attn: np.ndarray, n_prefix: int, tile: int, alpha: float, beta: float, gamma: float,
                     rel: float, normalize: str = "causal", sink: bool = True) -> tuple[bytes, bytes, list]:
    """attn: [Hq, Lp, Lp] fp32 probabilities of one layer -> (la bytes, ca bytes, near-threshold cells: within
    `rel` of a threshold, relatively, where two roundings of the forward may fall either side).

    Straight from the SPEC text, with no vectorised tricks shared with the code under test.
    """
    hq = attn.shape[0]
    a = attn[:, n_prefix:, n_prefix:]  # document queries x document keys
    n = a.shape[1]
    p = -(-n // tile)
    alpha32, beta32, gamma32 = np.float32(alpha), np.float32(beta), np.float32(gamma)
    la_out, ca_out, near = bytearray(), bytearray(), []
    for h in range(hq):
        la = bytearray(-(-(p * (p + 1) // 2) // 8))
        for i in range(p):
            for j in range(i + 1):
                best = np.float32(0)
                for q in range(i * tile, min((i + 1) * tile, n)):
                    hi = min((j + 1) * tile, n, q + 1)
                    if hi > j * tile:
                        best = max(best, a[h, q, j * tile:hi].max())
                bit = best >= alpha32 or i == j or (sink and j == 0)
                if abs(float(best) - alpha) <= rel * alpha and i != j and not (sink and j == 0):
                    near.append(("la", h, i, j))
                nbit = i * (i + 1) // 2 + j
                if bit:
                    la[nbit // 8] |= 1 << (7 - nbit % 8)
        ca = bytearray(-(-p // 8))
        for k in range(n):
            col = a[h, k:, k]  # queries q >= k
            cnt = int((col >= beta32).sum())
            denom = (n - k) if normalize == "causal" else (k + 1)
            if np.float32(cnt) / np.float32(denom) >= gamma32:
                ca[(k // tile) // 8] |= 1 << (7 - (k // tile) % 8)
            if np.any(np.abs(col - beta) <= rel * beta):
                near.append(("ca", h, k))
        la_out += la
        ca_out += ca
    return bytes(la_out), bytes(ca_out), near


@pytest.fixture(scope="module")
def eager_model():
    model, tokenizer = smollm2(attn_implementation="eager")
    return model, tokenizer


@pytest.mark.parametrize("tile", [16, 64])
def test_cpu_profile_matches_brute_force(eager_model, tile):
    model, tokenizer = eager_model
    cfg = ProfileConfig(tile=tile)
    # Documents of several lengths; cut so some are not multiples of the tile and one is shorter than a tile.
    texts = sorted(wiki_texts(40, step=7), key=len)[-3:]  # the longest leads: several pages per tile
    docs = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    docs = [docs[0][:230], docs[1][:161], docs[2][:13]]
    assert any(len(d) % tile for d in docs)
    prefix = profiling_prefix_ids(tokenizer, cfg)
    expected = []
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        for ids in docs:
            out = model.base_model(input_ids=torch.tensor([prefix + ids]), output_attentions=True)
            la, ca, near = b"", b"", []
            for layer, layer_attn in enumerate(out.attentions):
                # The profiler's attention and the eager one round differently from the first layer on.
                l_la, l_ca, l_near = brute_force_bits(layer_attn[0].float().numpy(), len(prefix), tile,
                                                      cfg.alpha, cfg.beta, cfg.gamma,
                                                      model_rounding(model.config, depth=layer + 1))
                la, ca, near = la + l_la, ca + l_ca, near + l_near
            expected.append((la, ca, near))
    profiler = Profiler(model, tokenizer, cfg, "torch")
    for ids, (la, ca, near) in zip(docs, expected):
        got = profiler.profile(ids)
        la_diff = np.unpackbits(np.frombuffer(la, np.uint8)) != np.unpackbits(np.frombuffer(got.la, np.uint8))
        ca_diff = np.unpackbits(np.frombuffer(ca, np.uint8)) != np.unpackbits(np.frombuffer(got.ca, np.uint8))
        print(f"L={len(ids)} tile={tile}: LA flips {la_diff.sum()}, CA flips {ca_diff.sum()}, "
              f"near-threshold cells {len(near)}")
        # Exact unless a probability lies within float rounding of a threshold (then at most that many flips).
        assert la_diff.sum() + ca_diff.sum() <= len(near)
        assert len(got.la) == len(la) and len(got.ca) == len(ca)


def test_profile_bits_sizes_and_forced_tiles(eager_model):
    model, tokenizer = eager_model
    cfg = ProfileConfig(tile=16, alpha=1.0, beta=1.0, gamma=1.0)
    profiler = Profiler(model, tokenizer, cfg, "torch")
    ids = tokenizer(wiki_texts(1)[0], add_special_tokens=False).input_ids[:40]  # P = 3
    bits = profiler.profile(ids)
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert len(bits.la) == n_layers * n_heads * 1  # 6 tiles -> 1 byte
    # alpha = 1: only the diagonal and the sink column survive: tiles (0,0) (1,0) (1,1) (2,0) (2,2) -> 111101 00
    assert set(bits.la) == {0b11110100}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_local_model_folders_of_each_family(family, eager_model, tmp_path):
    """`--model PATH` for every supported family: load_model + AttentionInterface capture give the brute-force
    bits (tiny random weights: this checks the plumbing and shapes, not attention patterns)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from sift.model import load_model

    _, tokenizer = eager_model
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    torch.manual_seed(0)
    config = cls(vocab_size=49152, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    model, tok, identity = load_model(str(tmp_path / "m"), attn_implementation="eager")
    assert (identity.model_type, identity.n_layers, identity.n_heads, identity.n_kv_heads) == (family, 2, 6, 2)
    cfg = ProfileConfig(tile=16, alpha=0.02, beta=0.05, gamma=0.2)  # mid thresholds: mixed bits on random weights
    ids = tok(wiki_texts(1)[0], add_special_tokens=False).input_ids[:70]
    prefix = profiling_prefix_ids(tok, cfg)
    with torch.inference_mode():
        out = model.base_model(input_ids=torch.tensor([prefix + ids]), output_attentions=True)
    la, ca, near = b"", b"", []
    for layer, layer_attn in enumerate(out.attentions):
        l_la, l_ca, l_near = brute_force_bits(layer_attn[0].float().numpy(), len(prefix), 16,
                                              cfg.alpha, cfg.beta, cfg.gamma, model_rounding(config, depth=layer + 1))
        la, ca, near = la + l_la, ca + l_ca, near + l_near
    got = Profiler(model, tok, cfg, "torch").profile(ids)
    flips = (np.unpackbits(np.frombuffer(la, np.uint8)) != np.unpackbits(np.frombuffer(got.la, np.uint8))).sum() \
        + (np.unpackbits(np.frombuffer(ca, np.uint8)) != np.unpackbits(np.frombuffer(got.ca, np.uint8))).sum()
    assert flips <= len(near), f"{family}: {flips} flips"
    assert 0 < np.unpackbits(np.frombuffer(got.la, np.uint8)).mean() < 1
