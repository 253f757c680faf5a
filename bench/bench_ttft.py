"""End-to-end TTFT on one GPU: dense (transformers + SDPA, plain forward of the unsegmented prompt) vs SIFT
(`SiftEngine`, sparse position-free prefill), in the same run.

1. An 8B Llama-shaped model (hidden 4096, 32 layers, 32 query / 8 kv heads, intermediate 14336, vocab 128256,
   llama3 RoPE with theta 500000), random bf16 weights built on the GPU with `from_config` (no download).
   Prompts of 16K / 32K / 64K tokens (`--contexts`): a 1-token prefix (BOS), 2048-token documents of random
   token ids, a 512-token query. The documents' bits, written to a temporary index, come from one of
   three sources (`--masks`):
     anchor  an "anchor generator" (tile 128 = the kernel block): per (layer, head) and document, LA keeps the
             diagonal, the first page and random tiles up to 30% of the lower triangle; CA keeps the first page
             and random pages up to 6%;
     paper   the same generator at the SIFT paper's sparsities for Llama-3-8B on LongBench (LA sparsity 72.7%,
             CA sparsity 94.2%): LA keeps 27.3% of the lower triangle, CA 5.8% of the pages;
     real    real SIFT bits of SmolLM2-135M-Instruct on 2048-token Wikipedia documents (bench/masks.py, the
             attention benchmark's mask (b); tile 64, coarsened to the kernel block by the engine's decode):
             document i takes the stored document i mod 24; layer l of the model takes SmolLM2's layer
             l * 30 // 32 and head h that layer's head h mod 9.
   Token ids travel as text through a stand-in tokenizer (ids written as decimal numbers), since the engine's
   API takes text.
2. SmolLM2-135M-Instruct on HotpotQA prompts (system prompt + 10 paragraphs + question), bits profiled on the
   GPU (tile 16, kernel block 64), when the default model is installed (`make install`); skipped otherwise.

Each configuration: one warm-up (Triton compilation), then the median of `--reps` runs, synchronised wall
clock. `fetch+decode` is the share of SIFT's TTFT spent in `index.fetch` and the per-layer bits -> block
indices decode (CUDA events). Every speed-up is against the dense forward of the same prompt in the same run.

Before anything is timed, the engine is checked on a two-document prompt of the 8B model (`engine_check`): its
logits in modes "sift" and "dense" through the Triton kernels against an fp32 run of the same weights through
the kernels' ref twins, within twice the error of the bf16 ref twins (bench/common.py `check_within_twin`).
Exit status 1 after writing the result if a check failed. Writes bench/results/ttft.json and prints a compact
table last.

    python bench/bench_ttft.py [--contexts 16384,32768,65536] [--masks anchor,paper,real] [--reps 3]
                               [--smollm2-questions 4]
    python bench/bench_ttft.py --smoke      # tiny random Llama on CPU, fp16, Triton interpreter: the script runs
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from sift import format as fmt  # noqa: E402
from sift.errors import SiftError  # noqa: E402
from sift.format import content_hash, n_pages  # noqa: E402
from sift.kernels.bits import pack_msb  # noqa: E402
from sift.pipeline import index as idx  # noqa: E402
from sift.runtime import KVStore, Request, SiftEngine, SiftIndex  # noqa: E402

TILE = 128
LA_DENSITY, CA_DENSITY = 0.30, 0.06
# The SIFT paper's sparsities for Llama-3-8B on LongBench: 72.7% of LA tiles and 94.2% of CA pages skipped.
PAPER_LA_DENSITY, PAPER_CA_DENSITY = 1 - 0.727, 1 - 0.942
MASKS = ("anchor", "paper", "real")
# The kernels' output against the bf16 ref twins', both against an fp32 reference: within this factor.
TWIN_FACTOR = 2.0


# ------------------------------------------------------------------------------------------------ helpers


class SyntheticIndex(SiftIndex):
    """The random model has no folder to fingerprint: check shapes only."""

    def check_model(self, model) -> None:
        c = model.config
        if (c.num_hidden_layers, c.num_attention_heads) != (self.n_layers, self.n_heads):
            raise SiftError(f"synthetic index of {self.n_layers} layers x {self.n_heads} heads does not fit the "
                            f"model's {c.num_hidden_layers} x {c.num_attention_heads}")


def write_index(root: pathlib.Path, docs: dict[str, list[int]], bits: dict[str, tuple[bytes, bytes]], *,
                tile: int, config, fp: str = "synthetic") -> None:
    """A one-shard index of `docs` with the given (LA, CA) bits, written by the builder's own writers."""
    rows = [dict(doc_id=d, content_hash=content_hash(ids), n_tokens=len(ids), la_bits=bits[d][0],
                 ca_bits=bits[d][1], source="bench", la_density=[], ca_density=[]) for d, ids in docs.items()]
    idx.prepare_dir(root)
    info = idx.write_table(root, pa.Table.from_pylist(rows, schema=fmt.DOCS_SCHEMA), kind="part",
                           profile_key="bench", backend="synthetic")
    idx.commit_manifest(root, fmt.Manifest.from_dict({
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "generation": 1, "created_at": idx.now_iso(),
        "model": {"name": "bench", "fingerprint": fp, "model_type": config.model_type,
                  **dataclasses.asdict(fmt.ModelGeometry.from_config(config)), "rope": {},
                  "max_position_embeddings": config.max_position_embeddings},
        "profile": {"tile": tile, "prefix_token_ids": [], "profile_key": "bench"},
        "shards": [info.to_dict()], "errors": None, "documents": len(rows)}))


def anchor_bits(n_tokens: int, vectors: int, gen: torch.Generator, la_density: float = LA_DENSITY,
                ca_density: float = CA_DENSITY) -> tuple[bytes, bytes]:
    """LA: diagonal + first page + random tiles up to la_density of the lower triangle; CA: first page +
    random pages up to ca_density."""
    p = n_pages(n_tokens, TILE)
    rows, cols = torch.tril_indices(p, p)
    forced = (rows == cols) | (cols == 0)
    extra = max(0.0, la_density * len(rows) - float(forced.sum())) / max(1, int((~forced).sum()))
    la = forced[None, :] | (torch.rand(vectors, len(rows), generator=gen) < extra)
    ca_extra = max(0.0, ca_density * p - 1) / max(1, p - 1)
    ca = torch.rand(vectors, p, generator=gen) < ca_extra
    ca[:, 0] = True
    return pack_msb(la).numpy().tobytes(), pack_msb(ca).numpy().tobytes()


def real_bits(n_tokens: int, n_layers: int, n_heads: int, doc: int) -> tuple[bytes, bytes]:
    """Stored SmolLM2 bits (bench/masks.py, mask (b)'s documents) for a model of n_layers x n_heads: document
    `doc` mod 24, cut to n_tokens (a multiple of the stored tile); layer l takes SmolLM2's layer
    l * L_s // n_layers, head h that layer's head h mod H_s."""
    from masks import cut_bits, load_bits

    stored = load_bits()
    d, n_vec = doc % len(stored.n_tokens), stored.n_layers * stored.n_heads
    if n_tokens > stored.n_tokens[d] or n_tokens % stored.tile:
        raise SiftError(f"real bits: documents of {n_tokens} tokens; the stored ones have {stored.n_tokens[d]} "
                        f"(use --doc-tokens {stored.n_tokens[d]} or a shorter multiple of {stored.tile})")
    la, ca = stored.la[d], stored.ca[d]
    if n_tokens < stored.n_tokens[d]:
        la, ca = cut_bits(la, ca, stored.n_tokens[d], n_tokens, stored.tile, n_vec)
    vec = [(layer * stored.n_layers // n_layers) * stored.n_heads + h % stored.n_heads
           for layer in range(n_layers) for h in range(n_heads)]
    la_rows = np.frombuffer(la, np.uint8).reshape(n_vec, -1)
    ca_rows = np.frombuffer(ca, np.uint8).reshape(n_vec, -1)
    return la_rows[vec].tobytes(), ca_rows[vec].tobytes()


def real_tile() -> int:
    from masks import load_bits

    return load_bits().tile


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> tuple[float, object]:
    """Median wall-clock seconds of `reps` synchronised calls after one warm-up (compilation, allocator)."""
    fn()
    times, out = [], None
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def closeness(tag: str, logits: torch.Tensor, reference: list[torch.Tensor]) -> dict:
    """Worst request: max |diff| relative to the largest reference logit, cosine similarity, and top-1
    agreement (fragile with random weights, whose logits are nearly flat: read the first two)."""
    rel = max(common.rel_err(a, b) for a, b in zip(logits, reference))
    cos = min(float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(logits, reference))
    top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(logits, reference)) / len(reference)
    return {f"{tag}_rel_err": rel, f"{tag}_cosine": cos, f"{tag}_top1_agree": top1}


def engine_check(model, engine: SiftEngine, req: Request, modes: tuple[str, ...], checks: common.Checks,
                 store_gib: float = 0.0, model32=None) -> dict:
    """The engine's kernels on `req`, per mode: last-position logits of `engine` (the Triton backend on the
    model's dtype) against an fp32 copy of the same weights (`model32`, made here when None) through the
    kernels' ref twins (backend "torch"), within TWIN_FACTOR times the error of the ref twins at the model's
    dtype (`check_within_twin`). The reuse modes get a KV store of `store_gib` per engine, empty before each
    call. -> the figures checked."""
    model32 = copy.deepcopy(model).float() if model32 is None else model32
    store = (lambda: KVStore(hbm_bytes=int(store_gib * 2**30), dram_bytes=0)) if store_gib else (lambda: None)
    twin = SiftEngine(model, engine.tokenizer, engine.index, kv_store=store(), backend="torch", block=engine.block)
    ref = SiftEngine(model32, engine.tokenizer, engine.index, kv_store=store(), backend="torch", block=engine.block)
    out = {}
    for mode in modes:
        logits = []
        for e in (engine, twin, ref):
            if e.kv_store is not None:
                e.kv_store.clear()
            logits.append(e.prefill([req], mode=mode).logits[0].float())
        c = common.check_within_twin(f"engine/{mode}/logits_vs_fp32", *logits, factor=TWIN_FACTOR,
                                     ref_dtype=torch.float32, depth=model.config.num_hidden_layers)
        checks.add(c)
        out[mode] = dict(rel_err=c.value, twin_rel_err=common.relative_error(logits[1], logits[2]), bound=c.bound)
    if engine.kv_store is not None:
        engine.kv_store.clear()
    del model32, twin, ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def compare(name: str, model, engine: SiftEngine, reqs: list[Request], reps: int, **labels) -> dict:
    """Dense (plain SDPA forward of each unsegmented prompt) vs the engine in sift mode, batch = reqs."""
    prompts = [torch.tensor([engine.prompt_ids(r)], device=engine.device) for r in reqs]

    @torch.inference_mode()
    def dense():
        return [model(input_ids=p, logits_to_keep=1).logits[0, -1].float() for p in prompts]

    t_dense, dense_logits = timed(dense, reps)
    t_sift, res = timed(lambda: engine.prefill(reqs, mode="sift"), reps)
    t_engine_dense, res_dense = timed(lambda: engine.prefill(reqs, mode="dense"), reps)
    st = res.stages
    row = dict(name=name, **labels, tokens=sum(res.n_tokens), requests=len(reqs), backend=res.backend,
               ttft_dense_s=t_dense, ttft_sift_s=t_sift, ttft_engine_dense_s=t_engine_dense,
               speedup_vs_dense=t_dense / t_sift, tile_fraction=res.tile_fraction, fetch_s=st["fetch"],
               decode_s=st["decode"], attention_s=st["attention"], rest_s=st["rest"],
               fetch_decode_fraction=(st["fetch"] + st["decode"]) / st["total"],
               **closeness("engine_dense_vs_sdpa", res_dense.logits, dense_logits),
               **closeness("sift_vs_sdpa", res.logits, dense_logits))
    print(json.dumps(row), flush=True)
    return row


# -------------------------------------------------------------------------------------------- benchmarks


def llama_config(smoke: bool):
    """The 8B Llama shape, or (smoke) a 2-layer model of the same family small enough for a CPU."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if smoke:
        return LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, vocab_size=4096, max_position_embeddings=16384,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                       tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, rope_parameters=rope)


def build_llama(smoke: bool, smoke_dtype: torch.dtype = torch.float16):
    """The random-weight model (8B shape, bf16 on the GPU; --smoke: 2 layers, `smoke_dtype` on CPU)."""
    from transformers import AutoModelForCausalLM

    config = llama_config(smoke)
    device, dtype = ("cpu", smoke_dtype) if smoke else ("cuda", torch.bfloat16)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    print(f"{config.num_hidden_layers}-layer Llama built in {time.perf_counter() - t0:.1f}s", flush=True)
    return model


def masked_engine(model, tmp: pathlib.Path, mask: str, docs: dict[str, list[int]], gen: torch.Generator,
                  kv_store: KVStore | None = None) -> SiftEngine:
    """An engine over a temporary index of `docs` with bits from `mask` (module docstring)."""
    config = model.config
    vectors = config.num_hidden_layers * config.num_attention_heads
    if mask == "real":
        tile = real_tile()
        bits = {d: real_bits(len(t), config.num_hidden_layers, config.num_attention_heads, i)
                for i, (d, t) in enumerate(docs.items())}
    else:
        tile = TILE
        la, ca = (LA_DENSITY, CA_DENSITY) if mask == "anchor" else (PAPER_LA_DENSITY, PAPER_CA_DENSITY)
        bits = {d: anchor_bits(len(t), vectors, gen, la, ca) for d, t in docs.items()}
    write_index(tmp / f"index-{mask}", docs, bits, tile=tile, config=config)
    index = SyntheticIndex.open(tmp / f"index-{mask}", device=model.device)
    # The Triton kernels (on CPU in the interpreter, under --smoke), the block of a GPU serving the 8B shape.
    triton = model.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return SiftEngine(model, IdTokenizer(config.bos_token_id, config.eos_token_id), index, block=TILE,
                      backend="triton" if triton else "torch", kv_store=kv_store)


def random_docs(config, n_docs: int, doc_tokens: int, gen: torch.Generator) -> dict[str, list[int]]:
    return {f"doc{i}": torch.randint(3, config.vocab_size, (doc_tokens,), generator=gen).tolist()
            for i in range(n_docs)}


def as_request(docs: dict[str, list[int]], names: list[str], query: list[int]) -> Request:
    return Request("", [(d, " ".join(map(str, docs[d]))) for d in names], " ".join(map(str, query)))


def bench_llama(tmp: pathlib.Path, contexts: list[int], masks: list[str], doc_tokens: int, query_tokens: int,
                reps: int, smoke: bool, checks: common.Checks) -> tuple[list[dict], dict]:
    """Random-weight Llama (8B shape) over prompts of `contexts` tokens of `doc_tokens`-token documents, with the
    bits of each of `masks`; the engine checked first. -> (rows, the engine check's figures)."""
    if not contexts:
        return [], {}
    model = build_llama(smoke)
    gen = torch.Generator().manual_seed(0)
    docs = random_docs(model.config, max(contexts) // doc_tokens, doc_tokens, gen)
    query = torch.randint(3, model.config.vocab_size, (query_tokens,), generator=gen).tolist()
    rows, check = [], {}
    for mask in masks:
        engine = masked_engine(model, tmp, mask, docs, gen)
        if not check:   # once: the kernels do not depend on where the bits came from
            check = engine_check(model, engine, as_request(docs, list(docs)[:2], query), ("sift", "dense"), checks)
            if not checks.ok:
                return rows, check
        for ctx in contexts:
            label = f"llama-smoke {ctx}" if smoke else f"llama-8B-random {ctx // 1024}K"
            req = as_request(docs, list(docs)[: ctx // doc_tokens], query)
            rows.append(compare(f"{label} {mask}", model, engine, [req], reps, mask=mask, context=ctx))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows, check


def bench_smollm2(tmp: pathlib.Path, n_questions: int, reps: int) -> list[dict]:
    """SmolLM2 on HotpotQA prompts with bits profiled on the GPU; skipped where the model is not installed."""
    if not n_questions:
        return []
    try:
        from sift.model import DEFAULT_MODEL, load_model
        from sift.quality.prompts import hotpot_request, load_questions

        model, tokenizer, identity = load_model(DEFAULT_MODEL, dtype="bfloat16", device="cuda")
    except (SiftError, ImportError, OSError) as e:
        print(f"SmolLM2 part skipped: {e}", flush=True)
        return []
    from sift.pipeline import ProfileConfig, Profiler

    reqs = [hotpot_request(q) for q in load_questions(n_questions)]
    docs = {d: tokenizer(t, add_special_tokens=False).input_ids for r in reqs for d, t in r.docs}
    model.set_attn_implementation("sdpa")
    profiler = Profiler(model, tokenizer, ProfileConfig(tile=16, dtype="bfloat16"), "triton")
    bits = {}
    for d, token_ids in docs.items():
        b = profiler.profile(token_ids)
        bits[d] = (b.la, b.ca)
    model.set_attn_implementation("sdpa")
    write_index(tmp / "smol", docs, bits, tile=16, config=model.config, fp=identity.fingerprint)
    index = SiftIndex.open(tmp / "smol", device="cuda")
    engine = SiftEngine(model, tokenizer, index, block=64)
    rows = [compare(f"smollm2 hotpotqa x{len(reqs)} (batch)", model, engine, reqs, reps)]
    rows += [compare("smollm2 hotpotqa x1", model, engine, reqs[:1], reps)]
    return rows


def print_table(rows: list[dict], reps: int) -> None:
    print(f"\n{'config':<34} {'tokens':>7} {'dense':>8} {'sift':>8} {'sift vs dense':>13} {'tiles':>6} "
          f"{'fetch+dec':>9} {'eng.dense':>9}")
    for r in rows:
        print(f"{r['name']:<34} {r['tokens']:>7} {r['ttft_dense_s'] * 1e3:>6.0f}ms {r['ttft_sift_s'] * 1e3:>6.0f}ms "
              f"{r['speedup_vs_dense']:>12.2f}x {r['tile_fraction']:>6.1%} {r['fetch_decode_fraction']:>9.1%} "
              f"{r['ttft_engine_dense_s'] * 1e3:>7.0f}ms")
    print(f"(TTFT = median of {reps} after a warm-up; sift vs dense = dense TTFT / sift TTFT, dense = transformers "
          f"SDPA forward of the unsegmented prompt in the same run; tiles = (head, query block, key block) triples "
          f"computed over dense causal; eng.dense = the engine with every block listed)")


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,65536",
                    help="prompt lengths of the 8B-shaped part, comma-separated ('' skips it)")
    ap.add_argument("--masks", default=",".join(MASKS), help=f"bits of the 8B-shaped part, of {MASKS}")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--smollm2-questions", type=int, default=0,
                    help="HotpotQA prompts of the SmolLM2 part (0 skips it)")
    args = ap.parse_args()
    masks = [m for m in args.masks.split(",") if m]
    if any(m not in MASKS for m in masks):
        raise SystemExit(f"--masks {args.masks!r}: choose from {MASKS}")
    if args.smoke:
        args.contexts, args.doc_tokens, args.query_tokens, args.reps, args.smollm2_questions = "512", 128, 32, 1, 0
    elif not torch.cuda.is_available():
        raise SystemExit("bench_ttft needs a CUDA GPU (or --smoke)")
    contexts = [int(x) for x in args.contexts.split(",") if x]
    t0 = time.perf_counter()
    checks = common.Checks()
    with tempfile.TemporaryDirectory() as tmp:
        rows, check = bench_llama(pathlib.Path(tmp), contexts, masks, args.doc_tokens, args.query_tokens, args.reps,
                                  args.smoke, checks)
        if checks.ok:
            rows += bench_smollm2(pathlib.Path(tmp), args.smollm2_questions, args.reps)
    setup = dict(doc_tokens=args.doc_tokens, query_tokens=args.query_tokens, prefix_tokens=1, reps=args.reps,
                 masks=masks, tile=TILE, la_density=LA_DENSITY, ca_density=CA_DENSITY,
                 paper_la_density=PAPER_LA_DENSITY, paper_ca_density=PAPER_CA_DENSITY, smoke=args.smoke)
    common.write_result("ttft", dict(setup=setup, seconds=time.perf_counter() - t0, engine_check=check,
                                     checks=checks.to_json(), ok=checks.ok, rows=rows), common.out_dir(args))
    print_table(rows, args.reps)
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
