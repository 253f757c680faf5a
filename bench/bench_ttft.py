"""End-to-end TTFT on one GPU: dense (transformers + SDPA, plain forward of the unsegmented prompt) vs SIFT
(`SiftEngine`, sparse position-free prefill), in the same run.

1. An 8B Llama-shaped model (hidden 4096, 32 layers, 32 query / 8 kv heads, intermediate 14336, vocab 128256,
   llama3 RoPE with theta 500000), random bf16 weights built on the GPU with `from_config` (no download).
   Prompts of 16K / 32K / 64K tokens: a 1-token prefix (BOS), 2048-token documents of random token ids, a
   512-token query. Bits from an "anchor generator" written to a temporary index (tile 128 = the kernel
   block): per (layer, head) and document, LA keeps the diagonal, the first page and random tiles up to 30% of
   the lower triangle; CA keeps the first page and random pages up to 6%.
   Token ids travel as text through a stand-in tokenizer (ids written as decimal numbers), since the engine's
   API takes text.
2. SmolLM2-135M-Instruct on HotpotQA prompts (system prompt + 10 paragraphs + question), bits profiled on the
   GPU (tile 16, kernel block 64), when its weights are available (`source bench/device_env.sh`); skipped
   otherwise.

Each configuration: one warm-up (Triton compilation), then the median of REPS runs, synchronised wall clock.
`fetch+decode` is the share of SIFT's TTFT spent in `index.fetch` and the per-layer bits -> CSR decode (CUDA
events). Writes $OUT/ttft.json (or ./ttft.json) and prints a compact table last.

Run from the repository root on the GPU machine: `python3 bench/bench_ttft.py` (the package on PYTHONPATH, or
this checkout).
"""
from __future__ import annotations

import gc
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[1]
from _checkout import use_checkout  # noqa: E402

use_checkout()

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from sift.errors import SiftError  # noqa: E402
from sift.kernels.bits import n_pages, pack_msb  # noqa: E402
from sift import format as fmt  # noqa: E402
from sift.pipeline import index as idx  # noqa: E402
from sift.format import content_hash  # noqa: E402
from sift.runtime import Request, SiftEngine, SiftIndex  # noqa: E402

# TTFT_CONTEXTS="" runs only the SmolLM2 part.
CONTEXTS = tuple(int(x) for x in os.environ.get("TTFT_CONTEXTS", "16384,32768,65536").split(",") if x)
DOC_TOKENS, QUERY_TOKENS = 2048, 512
TILE = 128
LA_DENSITY, CA_DENSITY = 0.30, 0.06
REPS = 3
SMOL_QUESTIONS = 4


# ------------------------------------------------------------------------------------------------ helpers


class IdTokenizer:
    """Stand-in tokenizer: text is token ids written as decimal numbers separated by spaces."""

    def __init__(self, bos: int, eos: int):
        self.bos_token_id, self.eos_token_id = bos, eos

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [int(t) for t in text.split()]
        return SimpleNamespace(input_ids=([self.bos_token_id] if add_special_tokens else []) + ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class SyntheticIndex(SiftIndex):
    """The random model has no folder to fingerprint: check shapes only."""

    def check_model(self, model) -> None:
        c = model.config
        assert (c.num_hidden_layers, c.num_attention_heads) == (self.n_layers, self.n_heads)


def write_index(root: pathlib.Path, docs: dict[str, list[int]], bits: dict[str, tuple[bytes, bytes]], *,
                tile: int, config, fp: str = "synthetic") -> None:
    rows = [dict(doc_id=d, content_hash=content_hash(ids), n_tokens=len(ids), la_bits=bits[d][0],
                 ca_bits=bits[d][1], source="bench", la_density=[], ca_density=[]) for d, ids in docs.items()]
    idx.prepare_dir(root)
    info = idx.write_table(root, pa.Table.from_pylist(rows, schema=fmt.DOCS_SCHEMA), kind="part",
                           profile_key="bench", backend="synthetic")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    idx.commit_manifest(root, fmt.Manifest.from_dict({
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "generation": 1, "created_at": idx.now_iso(),
        "model": {"name": "bench", "fingerprint": fp, "model_type": config.model_type,
                  "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
                  "n_kv_heads": config.num_key_value_heads, "head_dim": head_dim, "rope": {},
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


def timed(fn, reps: int = REPS) -> tuple[float, object]:
    fn()  # warm-up: Triton compilation, allocator
    times, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def closeness(tag: str, logits: torch.Tensor, reference: list[torch.Tensor]) -> dict:
    """Worst request: max |diff| relative to the largest reference logit, cosine similarity, and top-1
    agreement (fragile with random weights, whose logits are nearly flat: read the first two)."""
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, reference))
    cos = min(float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(logits, reference))
    top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(logits, reference)) / len(reference)
    return {f"{tag}_rel_err": rel, f"{tag}_cosine": cos, f"{tag}_top1_agree": top1}


def compare(name: str, model, engine: SiftEngine, reqs: list[Request]) -> dict:
    """Dense (plain SDPA forward of each unsegmented prompt) vs the engine in sift mode, batch = reqs."""
    prompts = [torch.tensor([engine.prompt_ids(r)], device="cuda") for r in reqs]

    @torch.inference_mode()
    def dense():
        return [model(input_ids=p, logits_to_keep=1).logits[0, -1].float() for p in prompts]

    t_dense, dense_logits = timed(dense)
    t_sift, res = timed(lambda: engine.prefill(reqs, mode="sift"))
    t_kernel_dense, res_dense = timed(lambda: engine.prefill(reqs, mode="dense"))
    st = res.stages
    row = dict(name=name, tokens=sum(res.n_tokens), requests=len(reqs), ttft_dense_s=t_dense, ttft_sift_s=t_sift,
               ttft_engine_dense_s=t_kernel_dense, speedup=t_dense / t_sift, tile_fraction=res.tile_fraction,
               fetch_s=st["fetch"], decode_s=st["decode"], attention_s=st["attention"], rest_s=st["rest"],
               fetch_decode_fraction=(st["fetch"] + st["decode"]) / st["total"],
               **closeness("engine_dense_vs_sdpa", res_dense.logits, dense_logits),
               **closeness("sift_vs_sdpa", res.logits, dense_logits))
    print(json.dumps(row), flush=True)
    return row


# -------------------------------------------------------------------------------------------- benchmarks


def bench_8b(tmp: pathlib.Path) -> list[dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if not CONTEXTS:
        return []
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    print(f"8B model built in {time.perf_counter() - t0:.1f}s", flush=True)
    gen = torch.Generator().manual_seed(0)
    n_docs = max(CONTEXTS) // DOC_TOKENS
    docs = {f"doc{i}": torch.randint(1000, 120000, (DOC_TOKENS,), generator=gen).tolist() for i in range(n_docs)}
    vectors = config.num_hidden_layers * config.num_attention_heads
    bits = {d: anchor_bits(len(ids), vectors, gen) for d, ids in docs.items()}
    write_index(tmp / "index8b", docs, bits, tile=TILE, config=config)
    index = SyntheticIndex.open(tmp / "index8b", device="cuda")
    engine = SiftEngine(model, IdTokenizer(128000, 128001), index)
    query = " ".join(map(str, torch.randint(1000, 120000, (QUERY_TOKENS,), generator=gen).tolist()))
    rows = []
    for ctx in CONTEXTS:
        names = list(docs)[: ctx // DOC_TOKENS]
        req = Request("", [(d, " ".join(map(str, docs[d]))) for d in names], query)
        rows.append(compare(f"llama-8B-random {ctx // 1024}K", model, engine, [req]))
        gc.collect()
        torch.cuda.empty_cache()
    del model, engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def bench_smollm2(tmp: pathlib.Path) -> list[dict]:
    try:
        from sift.model import DEFAULT_MODEL, load_model
        from sift.runtime import demo
        from sift.demo import hotpot_request, load_questions

        if not demo.DATA.exists():  # an installed package without its data: read this checkout's copy
            demo.DATA = ROOT / "runtime" / "data" / demo.DATA.name
        model, tokenizer, identity = load_model(DEFAULT_MODEL, dtype="bfloat16", device="cuda")
    except (SiftError, ImportError, OSError) as e:
        print(f"SmolLM2 part skipped: {e}", flush=True)
        return []
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler

    qs = load_questions(SMOL_QUESTIONS)
    reqs = [hotpot_request(q) for q in qs]
    docs = {d: tokenizer(t, add_special_tokens=False).input_ids for r in reqs for d, t in r.docs}
    model.set_attn_implementation("sdpa")
    profiler = Profiler(model, tokenizer, ProfileConfig(tile=16, dtype="bfloat16"), "triton")
    bits = {}
    for d, ids in docs.items():
        b = profiler.profile(ids)
        bits[d] = (b.la, b.ca)
    model.set_attn_implementation("sdpa")
    write_index(tmp / "smol", docs, bits, tile=16, config=model.config, fp=identity.fingerprint)
    index = SiftIndex.open(tmp / "smol", device="cuda")
    engine = SiftEngine(model, tokenizer, index, block=64)
    rows = [compare(f"smollm2 hotpotqa x{len(reqs)} (batch)", model, engine, reqs)]
    rows += [compare("smollm2 hotpotqa x1", model, engine, reqs[:1])]
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_ttft needs a CUDA GPU")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench_8b(pathlib.Path(tmp))
        rows += bench_smollm2(pathlib.Path(tmp))
    out = pathlib.Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=REPS, tile=TILE,
                  la_density=LA_DENSITY, ca_density=CA_DENSITY, seconds=time.perf_counter() - t0, rows=rows)
    (out / "ttft.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'config':<34} {'tokens':>7} {'dense':>8} {'sift':>8} {'speedup':>7} {'tiles':>6} "
          f"{'fetch+dec':>9} {'eng.dense':>9}")
    for r in rows:
        print(f"{r['name']:<34} {r['tokens']:>7} {r['ttft_dense_s'] * 1e3:>6.0f}ms {r['ttft_sift_s'] * 1e3:>6.0f}ms "
              f"{r['speedup']:>6.2f}x {r['tile_fraction']:>6.1%} {r['fetch_decode_fraction']:>9.1%} "
              f"{r['ttft_engine_dense_s'] * 1e3:>7.0f}ms")
    print(f"(TTFT = median of {REPS} after a warm-up; dense = transformers SDPA forward of the unsegmented "
          f"prompt; eng.dense = the engine's kernel with the dense pattern; written to {out / 'ttft.json'})")


if __name__ == "__main__":
    main()
