"""The benchmarks' correctness gates (bench/common.py) pass a correct kernel and reject a wrong one.

Each gate is the one a GPU script applies, with the script's own depth constants: the wrong kernels (a dropped
block, a perturbed output, a wrong rotation, a flipped bit) are computed on CPU with the kernels' ref twins, and
the kernels under test run on tests/helpers.py DEVICE (the GPU, or the Triton interpreter without one), fp16 (bf16
is broken in the interpreter) at tiny shapes.
Where a gate also runs in bf16 on the GPU, the test shows the wrong kernel's error exceeds the bf16 bound too.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402  (bench/common.py)

from sift.kernels.decode_attention import decode_attention, decode_attention_ref, layout_kv_table  # noqa: E402
from sift.kernels.layout import build_layout  # noqa: E402
from sift.kernels.rope import apply_rope_ref, rotate_key_blocks, rotate_key_blocks_ref  # noqa: E402
from sift.kernels.sparse_attention import sparse_attention, sparse_attention_ref  # noqa: E402

from .helpers import DEVICE, on_device  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
BLOCK, D = 16, 64


def inv_freq(d: int = D) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def csr(mask: torch.Tensor):
    counts = mask.flatten(0, 1).sum(1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    return indptr, mask.flatten(0, 1).nonzero()[:, 1].to(torch.int32)


# ----------------------------------------------------------------------------------------- the formula


def test_tolerance_is_c_u_sqrt_depth():
    """The bound written out from its definition: c * 2^-p * sqrt(depth), p the dtype's significand bits."""
    assert common.tolerance(torch.bfloat16, 4) == 4.0 * 2.0**-8 * 2.0
    assert common.tolerance(torch.float16, 9) == 4.0 * 2.0**-11 * 3.0
    assert common.tolerance(torch.float32, 1, c=1.0) == 2.0**-24


def test_relative_error_per_group():
    """Per group: one group off by 10% shows as 0.1 however many groups are exact; a zero reference group must
    be exactly zero; NaN is an infinite error."""
    ref = torch.ones(4, 3, 5)
    out = ref.clone()
    out[2] *= 1.1
    assert common.relative_error(out, ref, group_dims=1) == pytest.approx(0.1)
    assert common.relative_error(out, ref) == pytest.approx(0.1 / 2)   # the whole tensor dilutes it
    zero = torch.zeros(2, 3)
    assert common.relative_error(zero, zero, group_dims=1) == 0.0
    bad = zero.clone()
    bad[1, 0] = 1e-6
    assert common.relative_error(bad, zero, group_dims=1) == float("inf")
    nan = ref.clone()
    nan[0, 0, 0] = float("nan")
    assert common.relative_error(nan, ref) == float("inf")


def test_checks_exit_status():
    checks = common.Checks()
    assert checks.equal("same", torch.arange(3), torch.arange(3))
    assert checks.exit_status() == 0
    assert not checks.equal("csr", torch.tensor([0, 2, 3]), torch.tensor([0, 2, 4]))
    assert not checks.ok and checks.failed == ["csr"] and checks.exit_status() == 1
    assert [c["name"] for c in checks.to_json()] == ["same", "csr"]


# ------------------------------------------------------------------ prefill attention (bench_attention, check_sm90)


@pytest.fixture(scope="module")
def prefill_case():
    """One request of four segments (lengths not multiples of the block), 2 query / 1 KV head, fp16, a random
    causal block mask with the diagonal and the first block kept."""
    gen = torch.Generator().manual_seed(3)
    lay = build_layout([[("doc", n) for n in (40, 23, 50, 17)]], BLOCK)
    nb, n = lay.n_blocks, lay.n_slots
    causal = torch.ones(nb, nb, dtype=torch.bool).tril()
    mask = ((torch.rand(2, nb, nb, generator=gen) < 0.5) | torch.eye(nb, dtype=torch.bool)) & causal
    mask[:, :, 0] = True
    q, k, v = (torch.randn(h, n, D, generator=gen).to(torch.float16) for h in (2, 1, 1))
    return lay, mask, q, k, v


def attend(case, mask=None, rope=True, kernel=False):
    lay, full, q, k, v = case
    args = (q, k, v, *csr(full if mask is None else mask), lay.block_valid, lay.block_offset,
            inv_freq() if rope else None)
    if kernel:
        return sparse_attention(*on_device(*args), scale=D ** -0.5, block=BLOCK).cpu()
    return sparse_attention_ref(*args, scale=D ** -0.5, block=BLOCK)


def blocks(x):
    return x.unflatten(1, (-1, BLOCK))


@pytest.mark.parametrize("rope", [True, False])
def test_attention_gate_passes_the_kernel(prefill_case, rope):
    from bench_attention import DEPTH_ATTENTION, DEPTH_ATTENTION_ROPE

    depth = DEPTH_ATTENTION_ROPE if rope else DEPTH_ATTENTION
    check = common.check_close("twin", blocks(attend(prefill_case, rope=rope, kernel=True)),
                               blocks(attend(prefill_case, rope=rope)), torch.float16, depth, group_dims=2)
    print(check)
    assert check.ok


def test_attention_gate_rejects_a_dropped_block(prefill_case):
    from bench_attention import DEPTH_ATTENTION_ROPE

    mask = prefill_case[1]
    row = int(mask[1].sum(-1).argmax())            # the longest row of head 1: one of its blocks is dropped
    wrong = mask.clone()
    wrong[1, row, 0] = False
    ref = blocks(attend(prefill_case))
    out = blocks(attend(prefill_case, mask=wrong))
    for dtype in (torch.float16, torch.bfloat16):
        check = common.check_close("dropped block", out, ref, dtype, DEPTH_ATTENTION_ROPE, group_dims=2)
        print(check)
        assert not check.ok


def test_attention_gate_rejects_a_perturbed_output(prefill_case):
    """A kernel whose output is 1% off in one (head, query block): the fp16 gate rejects it, as the bf16 gate
    rejects 5% (its unit roundoff is 8x fp16's)."""
    from bench_attention import DEPTH_ATTENTION_ROPE

    ref = blocks(attend(prefill_case))
    for dtype, off in ((torch.float16, 0.01), (torch.bfloat16, 0.05)):
        out = ref.clone()
        out[0, 1] *= 1 + off
        assert not common.check_close("perturbed", out, ref, dtype, DEPTH_ATTENTION_ROPE, group_dims=2).ok


# ----------------------------------------------------------------------------------- decode (bench_decode)


@pytest.fixture(scope="module")
def decode_case():
    """One request: prefix, three documents, query; the next token's q, fp16 cache at segment-local positions."""
    gen = torch.Generator().manual_seed(5)
    lay = build_layout([[("prefix", 5), ("doc", 37), ("doc", 50), ("doc", 21), ("query", 9)]], BLOCK)
    k = lay.scatter(apply_rope_ref(torch.randn(2, lay.n_tokens, D, generator=gen), lay.token_local_pos, inv_freq()),
                    dim=1).to(torch.float16)
    v = lay.scatter(torch.randn(2, lay.n_tokens, D, generator=gen), dim=1).to(torch.float16)
    kv_indptr, kv_indices = layout_kv_table(lay)
    inputs = dict(q=torch.randn(1, 8, D, generator=gen).to(torch.float16), k_cache=k, v_cache=v,
                  q_offset=torch.tensor([lay.n_tokens], dtype=torch.int32), kv_indptr=kv_indptr, kv_indices=kv_indices,
                  block_valid=lay.block_valid, kv_offset=lay.block_offset[kv_indices.long()], inv_freq=inv_freq())
    return inputs


def decode(inputs, kernel=False, **changes):
    args = dict(inputs, **changes)
    if kernel:
        args = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in args.items()}
        return decode_attention(**args, scale=D ** -0.5, block=BLOCK)[0].cpu()
    return decode_attention_ref(**args, scale=D ** -0.5, block=BLOCK)[0]


def test_decode_gate_passes_the_kernel(decode_case):
    from bench_decode import DEPTH_DECODE

    for splits in (1, 3):
        check = common.check_close("twin", decode(decode_case, kernel=True, num_splits=splits), decode(decode_case),
                                   torch.float16, DEPTH_DECODE, group_dims=1)
        print(check)
        assert check.ok


def test_decode_gate_rejects_a_dropped_block_and_a_wrong_rotation(decode_case):
    from bench_decode import DEPTH_DECODE

    ref = decode(decode_case)
    ptr, idx = decode_case["kv_indptr"], decode_case["kv_indices"]
    dropped = decode(decode_case, kv_indptr=ptr - torch.tensor([0, 1], dtype=torch.int32),
                     kv_indices=idx[1:].contiguous(), kv_offset=decode_case["kv_offset"][1:].contiguous())
    shifted = decode(decode_case, kv_offset=decode_case["kv_offset"] + 3)   # every block rotated 3 positions off
    for name, out in (("dropped block", dropped), ("wrong rotation", shifted)):
        for dtype in (torch.float16, torch.bfloat16):
            check = common.check_close(name, out, ref, dtype, DEPTH_DECODE, group_dims=1)
            print(check)
            assert not check.ok


# ---------------------------------------------------------------------------------------- key pass (pass_floor)


def test_key_pass_gate():
    from pass_floor import DEPTH_KEY_PASS

    gen = torch.Generator().manual_seed(7)
    k = torch.randn(2, 4 * BLOCK, D, generator=gen).to(torch.float16)
    offset = torch.tensor([0, 100, 100, 70_000], dtype=torch.int32)
    ref = rotate_key_blocks_ref(k, offset, inv_freq(), block=BLOCK).unflatten(1, (4, BLOCK))
    good = rotate_key_blocks(*on_device(k, offset, inv_freq()), block=BLOCK).cpu().unflatten(1, (4, BLOCK))
    assert common.check_close("key pass", good, ref, torch.float16, DEPTH_KEY_PASS, group_dims=2).ok
    wrong = rotate_key_blocks_ref(k, offset + torch.tensor([0, 0, 1, 0], dtype=torch.int32), inv_freq(),
                                  block=BLOCK).unflatten(1, (4, BLOCK))   # block 2 rotated one position off
    for dtype in (torch.float16, torch.bfloat16):
        assert not common.check_close("key pass", wrong, ref, dtype, DEPTH_KEY_PASS, group_dims=2).ok


# ------------------------------------------------------ whole engines (check_engine_sm90, bench_ttft, bench_reuse)


@pytest.fixture(scope="module")
def tiny_engine_case():
    """A tiny random Llama in bf16 and its fp32 copy, one request of three documents; dense mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common import IdTokenizer
    from sift.runtime import Request

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=300, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model32 = copy.deepcopy(model).float()
    gen = torch.Generator().manual_seed(1)

    def text(n):
        return " ".join(map(str, torch.randint(3, 300, (n,), generator=gen).tolist()))

    req = Request("", [(f"d{i}", text(n)) for i, n in enumerate((40, 33, 51))], text(12))
    return model, model32, IdTokenizer(1, 2), req


def engine_logits(model, tokenizer, req, backend):
    from sift.runtime import SiftEngine

    engine = SiftEngine(model, tokenizer, None, backend=backend, block=BLOCK)
    return engine.prefill([req], mode="dense").logits[0].float()


def test_engine_gate(tiny_engine_case, monkeypatch):
    """The kernels' twins at bf16 ("reference" backend) pass against the fp32 run within TWIN_FACTOR x the torch
    backend's error; with the first key block of every row dropped, or every attention output 3% off, they fail."""
    from bench_ttft import TWIN_FACTOR
    from sift.runtime import backends

    model, model32, tok, req = tiny_engine_case
    ref = engine_logits(model32, tok, req, "torch")
    twin = engine_logits(model, tok, req, "torch")

    def gate(out):
        check = common.check_within_twin("logits", out, twin, ref, factor=TWIN_FACTOR, ref_dtype=torch.float32,
                                         depth=model.config.num_hidden_layers)
        print(check)
        return check.ok

    assert gate(engine_logits(model, tok, req, "reference"))
    attend = backends.ReferenceBackend._attend

    def drop_first_block(self, q, k, v, csr, meta, inv_freq, scale):
        ptr, idx = csr.indptr.long(), csr.indices
        keep = torch.ones(idx.numel(), dtype=torch.bool)
        starts = ptr[:-1][(ptr[1:] - ptr[:-1]) > 1]         # rows of more than one block lose their first
        keep[starts] = False
        counts = torch.zeros(ptr.numel() - 1, dtype=torch.long).index_add_(
            0, torch.repeat_interleave(torch.arange(ptr.numel() - 1), ptr[1:] - ptr[:-1]), keep.long())
        new_ptr = torch.zeros_like(csr.indptr)
        new_ptr[1:] = counts.cumsum(0)
        return attend(self, q, k, v, type(csr)(new_ptr, idx[keep].contiguous(), None), meta, inv_freq, scale)

    monkeypatch.setattr(backends.ReferenceBackend, "_attend", drop_first_block)
    assert not gate(engine_logits(model, tok, req, "reference"))
    monkeypatch.setattr(backends.ReferenceBackend, "_attend",
                        lambda self, *a, **kw: attend(self, *a, **kw) * 1.03)
    assert not gate(engine_logits(model, tok, req, "reference"))


def test_peer_gate(tiny_engine_case):
    """bench_reuse's check of the warm-cache peer: the query's forward over the cached context, against the fp32
    forward within TWIN_FACTOR x the bf16 dense forward's error. It passes; a cache read at the wrong positions,
    one that still holds a previous query's entries, or one missing part of the context fails."""
    from transformers import DynamicCache

    from bench_ttft import TWIN_FACTOR

    model, model32, _, req = tiny_engine_case
    ids = [int(t) for _, text in req.docs for t in text.split()] + [int(t) for t in req.query.split()]
    n, n_ctx = len(ids), len(ids) - len(req.query.split())
    x = torch.tensor([ids])

    def peer(positions, skip: int = 0, stale: bool = False):
        cache = DynamicCache(config=model.config)
        model(input_ids=x[:, skip:n_ctx], past_key_values=cache, use_cache=True)
        if stale:   # a previous request's query left in the cache
            model(input_ids=x[:, n_ctx:], position_ids=torch.arange(n_ctx, n)[None], past_key_values=cache,
                  use_cache=True)
        return model(input_ids=x[:, n_ctx:], position_ids=positions[None], past_key_values=cache,
                     use_cache=True).logits[0, -1].float()

    with torch.inference_mode():
        dense, dense32 = (m(input_ids=x).logits[0, -1].float() for m in (model, model32))
        for name, out, ok in (("right", peer(torch.arange(n_ctx, n)), True),
                              ("positions from 0", peer(torch.arange(n - n_ctx)), False),
                              ("stale query", peer(torch.arange(n_ctx, n), stale=True), False),
                              ("context cut", peer(torch.arange(n_ctx - 10, n - 10), skip=10), False)):
            check = common.check_within_twin(name, out, dense, dense32, factor=TWIN_FACTOR, ref_dtype=torch.float32,
                                             depth=model.config.num_hidden_layers)
            print(check)
            assert check.ok == ok


# ------------------------------------------------------------------------------- profiling (bench_profile)


def test_profile_gate_rejects_a_flipped_bit(monkeypatch):
    """bench_profile's check: every bit that differs from the reference must sit at a threshold. The kernel as
    it is passes; a kernel that drops one LA tile far from the threshold (the diagonal) fails."""
    import dataclasses

    import bench_profile
    from sift.kernels import profile as pk
    from sift.kernels.profile_ref import LayerBits

    # The smoke setup's shapes, on DEVICE (check_case draws its inputs and runs its oracle there).
    setup = dataclasses.replace(bench_profile.CPU_SMOKE, dev=DEVICE)
    case = dict(name="fp32 tiny", dtype=torch.float32, hq=2, hkv=1, d=64, n_prefix=1, n_doc=48, tile=16)
    assert bench_profile.check_case(setup, **case)["ok"]
    right = pk.profile_layer

    def wrong(*args, **kwargs):
        bits, extra = right(*args, **kwargs)
        la = bits.la.clone()
        la[0] ^= 0x80                    # the first LA bit: tile (0, 0), the diagonal, kept by every profile
        return LayerBits(la=la, ca=bits.ca), extra

    monkeypatch.setattr(pk, "profile_layer", wrong)
    assert not bench_profile.check_case(setup, **case)["ok"]
