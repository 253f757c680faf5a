"""End-to-end TTFT on one GPU: dense (transformers + SDPA, plain forward of the unsegmented prompt) vs SIFT
(`SiftEngine`, sparse position-free prefill), in the same run.

1. An 8B Llama-shaped model (hidden 4096, 32 layers, 32 query / 8 kv heads, intermediate 14336, vocab 128256,
   llama3 RoPE with theta 500000), random bf16 weights built on the GPU with `from_config` (no download).
   Prompts of 16K / 32K / 64K tokens (`--contexts`): a 1-token prefix (BOS), 2048-token documents of random
   token ids, a 512-token query. Bits from an "anchor generator" written to a temporary index (tile 128 = the
   kernel block): per (layer, head) and document, LA keeps the diagonal, the first page and random tiles up to
   30% of the lower triangle; CA keeps the first page and random pages up to 6%.
   Token ids travel as text through a stand-in tokenizer (ids written as decimal numbers), since the engine's
   API takes text.
2. SmolLM2-135M-Instruct on HotpotQA prompts (system prompt + 10 paragraphs + question), bits profiled on the
   GPU (tile 16, kernel block 64), when the default model is installed (`make install`); skipped otherwise.

Each configuration: one warm-up (Triton compilation), then the median of `--reps` runs, synchronised wall
clock. `fetch+decode` is the share of SIFT's TTFT spent in `index.fetch` and the per-layer bits -> block
indices decode (CUDA events). Writes bench/results/ttft.json and prints a compact table last.

    python bench/bench_ttft.py [--contexts 16384,32768,65536] [--reps 3] [--smollm2-questions 4]
    python bench/bench_ttft.py --smoke      # tiny random Llama on CPU (torch backend): checks the script runs
"""
from __future__ import annotations

import dataclasses
import gc
import json
import pathlib
import statistics
import tempfile
import time

import common  # bench/common.py (the script's folder is on sys.path)
from common import IdTokenizer

common.smoke_env()  # before any kernel module imports triton

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from sift import format as fmt  # noqa: E402
from sift.errors import SiftError  # noqa: E402
from sift.format import content_hash, n_pages  # noqa: E402
from sift.kernels.bits import pack_msb  # noqa: E402
from sift.pipeline import index as idx  # noqa: E402
from sift.runtime import Request, SiftEngine, SiftIndex  # noqa: E402

TILE = 128
LA_DENSITY, CA_DENSITY = 0.30, 0.06


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


def anchor_bits(n_tokens: int, vectors: int, gen: torch.Generator) -> tuple[bytes, bytes]:
    """LA: diagonal + first page + random tiles up to LA_DENSITY of the lower triangle; CA: first page +
    random pages up to CA_DENSITY."""
    p = n_pages(n_tokens, TILE)
    rows, cols = torch.tril_indices(p, p)
    forced = (rows == cols) | (cols == 0)
    extra = max(0.0, LA_DENSITY * len(rows) - float(forced.sum())) / max(1, int((~forced).sum()))
    la = forced[None, :] | (torch.rand(vectors, len(rows), generator=gen) < extra)
    ca_extra = max(0.0, CA_DENSITY * p - 1) / max(1, p - 1)
    ca = torch.rand(vectors, p, generator=gen) < ca_extra
    ca[:, 0] = True
    return pack_msb(la).numpy().tobytes(), pack_msb(ca).numpy().tobytes()


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


def compare(name: str, model, engine: SiftEngine, reqs: list[Request], reps: int) -> dict:
    """Dense (plain SDPA forward of each unsegmented prompt) vs the engine in sift mode, batch = reqs."""
    prompts = [torch.tensor([engine.prompt_ids(r)], device=engine.device) for r in reqs]

    @torch.inference_mode()
    def dense():
        return [model(input_ids=p, logits_to_keep=1).logits[0, -1].float() for p in prompts]

    t_dense, dense_logits = timed(dense, reps)
    t_sift, res = timed(lambda: engine.prefill(reqs, mode="sift"), reps)
    t_engine_dense, res_dense = timed(lambda: engine.prefill(reqs, mode="dense"), reps)
    st = res.stages
    row = dict(name=name, tokens=sum(res.n_tokens), requests=len(reqs), backend=res.backend,
               ttft_dense_s=t_dense, ttft_sift_s=t_sift, ttft_engine_dense_s=t_engine_dense,
               speedup=t_dense / t_sift, tile_fraction=res.tile_fraction, fetch_s=st["fetch"],
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


def bench_llama(tmp: pathlib.Path, contexts: list[int], doc_tokens: int, query_tokens: int, reps: int,
                smoke: bool) -> list[dict]:
    """Random-weight Llama (8B shape) over prompts of `contexts` tokens of `doc_tokens`-token documents."""
    from transformers import AutoModelForCausalLM

    if not contexts:
        return []
    config = llama_config(smoke)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    print(f"{config.num_hidden_layers}-layer Llama built in {time.perf_counter() - t0:.1f}s", flush=True)
    gen = torch.Generator().manual_seed(0)
    lo, hi = 3, config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=gen).tolist()

    docs = {f"doc{i}": ids(doc_tokens) for i in range(max(contexts) // doc_tokens)}
    vectors = config.num_hidden_layers * config.num_attention_heads
    bits = {d: anchor_bits(len(t), vectors, gen) for d, t in docs.items()}
    write_index(tmp / "index-llama", docs, bits, tile=TILE, config=config)
    index = SyntheticIndex.open(tmp / "index-llama", device=device)
    engine = SiftEngine(model, IdTokenizer(config.bos_token_id, config.eos_token_id), index)
    query = " ".join(map(str, ids(query_tokens)))
    rows = []
    for ctx in contexts:
        names = list(docs)[: ctx // doc_tokens]
        req = Request("", [(d, " ".join(map(str, docs[d]))) for d in names], query)
        label = f"llama-smoke {ctx}" if smoke else f"llama-8B-random {ctx // 1024}K"
        rows.append(compare(label, model, engine, [req], reps))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


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
    print(f"\n{'config':<34} {'tokens':>7} {'dense':>8} {'sift':>8} {'speedup':>7} {'tiles':>6} "
          f"{'fetch+dec':>9} {'eng.dense':>9}")
    for r in rows:
        print(f"{r['name']:<34} {r['tokens']:>7} {r['ttft_dense_s'] * 1e3:>6.0f}ms {r['ttft_sift_s'] * 1e3:>6.0f}ms "
              f"{r['speedup']:>6.2f}x {r['tile_fraction']:>6.1%} {r['fetch_decode_fraction']:>9.1%} "
              f"{r['ttft_engine_dense_s'] * 1e3:>7.0f}ms")
    print(f"(TTFT = median of {reps} after a warm-up; dense = transformers SDPA forward of the unsegmented "
          f"prompt; eng.dense = the engine with every block listed)")


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,32768,65536",
                    help="prompt lengths of the 8B-shaped part, comma-separated ('' skips it)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--query-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--smollm2-questions", type=int, default=4, help="HotpotQA prompts of the SmolLM2 part (0 skips it)")
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.doc_tokens, args.query_tokens, args.reps, args.smollm2_questions = "512", 256, 32, 1, 0
    elif not torch.cuda.is_available():
        raise SystemExit("bench_ttft needs a CUDA GPU (or --smoke)")
    contexts = [int(x) for x in args.contexts.split(",") if x]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench_llama(pathlib.Path(tmp), contexts, args.doc_tokens, args.query_tokens, args.reps, args.smoke)
        rows += bench_smollm2(pathlib.Path(tmp), args.smollm2_questions, args.reps)
    setup = dict(doc_tokens=args.doc_tokens, query_tokens=args.query_tokens, prefix_tokens=1, reps=args.reps,
                 tile=TILE, la_density=LA_DENSITY, ca_density=CA_DENSITY, smoke=args.smoke)
    common.write_result("ttft", dict(setup=setup, seconds=time.perf_counter() - t0, rows=rows),
                        common.out_dir(args))
    print_table(rows, args.reps)


if __name__ == "__main__":
    main()
