"""Builder throughput: `sift-build` on real text next to plain forwards of the same tokens by the same model on the
same device, all in one run -> bench/results/build.json (GPU) or build-cpu.json (--device cpu).

    python bench/bench_build.py --model 8b             # H200: 8B Llama shape, random bf16 weights, passages + chunks
    python bench/bench_build.py --device cpu           # CPU: SmolLM2-135M fp32 (torch backend), passages
    python bench/bench_build.py --smoke                # CPU: a 2-layer random model, tiny corpora (checks the script)
    python bench/bench_build.py --model 8b --criterion reader --passages 1000 --chunks 64   # the reader criterion
    python bench/bench_build.py --model 8b --chunks 0 --only-build   # one sift-build of the passages, its start-up

Models: "8b" (32 layers, 32 query / 8 KV heads, head_dim 128; random bf16 weights made on the device, saved with
SmolLM2's tokenizer as a local model folder), "smollm2" (the default model). Corpora, from the Wikipedia leads of
--data, written as jsonl into a temp folder: "passages" (100-word windows of each article, DPR-style) and "chunks"
(the articles back to back, cut into ~2,000-token pieces).

Each corpus is built twice by `sift-build`, exactly as a user runs it (a subprocess: Python, Ray, the model's
load, the stream): the whole corpus and its first half. The steady-state rate is the whole build's tokens over
the seconds from its actors' readiness to its last shard (`streaming_rate`), so it excludes the fixed start-up;
the fixed cost is the whole build's seconds minus its tokens at that rate, and each build's own breakdown
(`last_build.startup` in the manifest) is kept. The half build gives the two-size fit beside it (the whole
build's extra tokens over its extra seconds). A first small
build before them fills Triton's kernel cache (reported as "cold"). Then, in this process, the same model on the
same device runs, on the same documents (profiling prefix + document): a batch-1 forward (on GPU a subset, its
rate extrapolated), a padded batched forward (length-sorted, at most --batch-tokens padded tokens per batch,
attention mask, SDPA) before and after the build's own profiler on the same documents (the builder's steady
state without Ray, at the same moment and threads: on a shared machine the ratio to trust). The FLOP floor is
2 x non-embedding parameters x tokens + causal attention, at --peak-tflops. Prints a table last.

--criterion reader builds with `[profile] criterion = "reader"` (every document profiled before the shipped reader
text, 1024 tokens) -> build-reader.json / build-cpu-reader.json; tokens counted are still the documents' own, so
the rates say what a corpus costs. The in-process profiler then also runs the threshold criterion on the same
documents (`profiler_threshold_in_process`, `reader_over_threshold`: the reader criterion's time over it).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import parser, smoke_env

smoke_env()  # before anything imports triton

import torch  # noqa: E402
from common import out_dir, write_result  # noqa: E402

from sift.format import IndexReader  # noqa: E402
from sift.model import DEFAULT_MODEL, default_model_dir, fingerprint, load_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA_NAME = "wiki_vital_summaries_en.json.gz"
DATA_PLACES = [REPO / "shared" / "data" / DATA_NAME, Path("/work/shared/data") / DATA_NAME]
WORDS_PER_PASSAGE = 100
CHUNK_TOKENS = 2000


# ------------------------------------------------------------------------------------------------ model


def make_model(kind: str, device: str, folder: Path) -> tuple[str, dict]:
    """The model a build names (DEFAULT_MODEL or a folder) and what making it cost."""
    if kind == "smollm2":
        return DEFAULT_MODEL, {}
    from bench_profile_model import llama8b

    tok_dir = default_model_dir()
    t0 = time.perf_counter()
    model = llama8b(32 if kind == "8b" else 2, smoke=kind != "8b", vocab_size=None if kind == "8b" else 49152)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    made = time.perf_counter() - t0
    # A model folder is hashed once (`sift.model.fingerprint` remembers files older than two seconds): what every
    # build after the first one finds. The first hash is reported on its own.
    time.sleep(2.5)
    t0 = time.perf_counter()
    fingerprint(folder)
    return str(folder), {"made_seconds": made, "fingerprint_cold_seconds": time.perf_counter() - t0,
                         "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}


# ----------------------------------------------------------------------------------------------- corpora


def find_data(given: Path | None) -> Path:
    for path in ([given] if given else []) + [Path(os.environ.get("SIFT_BENCH_DATA", ""))] + DATA_PLACES:
        if path and path.is_file():
            return path
    raise SystemExit(f"{DATA_NAME} not found (looked in {[str(p) for p in DATA_PLACES]}): pass --data PATH")


def articles(data: Path) -> list[str]:
    leads = json.loads(gzip.decompress(data.read_bytes()))
    return [leads[title]["extract"] for title in sorted(leads) if leads[title]["extract"].strip()]


def passages(texts: list[str], n: int) -> list[str]:
    """DPR-style: each article cut into windows of WORDS_PER_PASSAGE words (a last window of at least 20)."""
    out = []
    for text in texts:
        words = text.split()
        for i in range(0, len(words), WORDS_PER_PASSAGE):
            window = words[i:i + WORDS_PER_PASSAGE]
            if len(window) >= 20:
                out.append(" ".join(window))
            if len(out) == n:
                return out
    return out


def chunks(texts: list[str], n: int, tokenizer, tokens: int) -> list[str]:
    """The articles back to back, cut at word boundaries into pieces of about `tokens` tokens."""
    words = "\n\n".join(texts).split(" ")
    per_word = len(tokenizer(" ".join(words[:20000]), add_special_tokens=False).input_ids) / 20000
    step = int(tokens / per_word)
    return [" ".join(words[i:i + step]) for i in range(0, len(words) - step + 1, step)][:n]


def write_corpus(folder: Path, texts: list[str], files: int = 8) -> Path:
    """texts as `files` jsonl files (ids in corpus order), so several tasks read and tokenise at once."""
    folder.mkdir(parents=True)
    per = math.ceil(len(texts) / files)
    for f in range(files):
        part = texts[f * per:(f + 1) * per]
        if part:
            (folder / f"part-{f:02d}.jsonl").write_text(
                "".join(json.dumps({"id": f"d{f * per + i:06d}", "text": t}) + "\n" for i, t in enumerate(part)))
    return folder


# ------------------------------------------------------------------------------------------------ builds


def write_config(path: Path, model: str, dtype: str, backend: str, batch_tokens: int, threads: int,
                 criterion: str = "threshold") -> Path:
    path.write_text(f'model = "{model}"\n[profile]\ntile = 64\ndtype = "{dtype}"\ncriterion = "{criterion}"\n'
                    f'[corpus]\ntoo_long = "split"\n'
                    f'[build]\nbackend = "{backend}"\nbatch_tokens = {batch_tokens}\nthreads = {threads}\n')
    return path


def build(corpus: Path, index: Path, config: Path, timeout: float) -> dict:
    """`sift-build` in a subprocess, as a user runs it: wall seconds from outside, and the build's own record."""
    shutil.rmtree(index, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "sift-build"), str(corpus), "--out", str(index), "--config",
           str(config), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"sift-build failed ({proc.returncode}): {proc.stderr[-3000:]}")
    last = IndexReader.open(index).manifest.last_build
    return {"wall_seconds": wall, "documents": last["profiled"], "tokens": last["tokens_profiled"],
            "tokens_per_s": last["tokens_profiled"] / wall, "last_build": last, "summary": proc.stdout.strip()}


# ---------------------------------------------------------------------------------------------- baselines


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def batch1_forward(model, seqs: list[list[int]], device: str) -> dict:
    with torch.inference_mode():
        for s in seqs[:2]:  # warm-up
            model.base_model(input_ids=torch.tensor([s], device=device), use_cache=False)
        _sync(device)
        t0 = time.perf_counter()
        for s in seqs:
            model.base_model(input_ids=torch.tensor([s], device=device), use_cache=False)
        _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s) for s in seqs)
    return {"sequences": len(seqs), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def padded_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped longest first, each group's rows x longest row at most `budget` (a longer row alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def padded_forward(model, seqs: list[list[int]], device: str, budget: int) -> dict:
    batches = padded_batches([len(s) for s in seqs], budget)

    def run(batch):
        width = len(seqs[batch[0]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
            mask[row, :len(seqs[i])] = 1
        model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    with torch.inference_mode():
        run(batches[-1])  # warm-up (the shortest rows)
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for batch in batches:
            run(batch)
        _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s) for s in seqs)
    padded = sum(len(b) * len(seqs[b[0]]) for b in batches)
    out = {"batches": len(batches), "tokens": tokens, "padded_tokens": padded, "seconds": seconds,
           "tokens_per_s": tokens / seconds}
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def profile_in_process(model, tokenizer, ids: list[list[int]], dtype: str, device: str, batch_tokens: int,
                       criterion: str = "threshold") -> dict:
    """The build's profiler (packs of batch_tokens, the backend a build picks) over the documents, timed after a
    warm-up pack."""
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler

    profiler = Profiler(model, tokenizer, ProfileConfig(dtype=dtype, criterion=criterion),
                        "triton" if device == "cuda" else "torch", batch_tokens=batch_tokens)
    profiler.profile_batch(ids[:4])
    _sync(device)
    t0 = time.perf_counter()
    results = profiler.profile_batch(ids)
    _sync(device)
    seconds = time.perf_counter() - t0
    failed = sum(isinstance(r, Exception) for r in results)
    tokens = sum(len(i) for i in ids)
    rows = sum(len(i) + len(profiler.prefix_ids) + len(profiler.reader_ids) for i in ids)
    return {"criterion": criterion, "tokens": tokens, "forward_rows": rows, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "failed": failed, "backend": profiler.backend_label}


def flop_floor(model, seqs: list[list[int]], peak_tflops: float) -> dict:
    """2 x non-embedding parameters per token (the base model: no LM head) + causal attention (QK^T and PV)."""
    cfg = model.config
    params = sum(p.numel() for n, p in model.base_model.named_parameters() if "embed_tokens" not in n)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens = sum(len(s) for s in seqs)
    attention = sum(4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * n * (n + 1) / 2 for n in
                    (len(s) for s in seqs))
    flops = 2 * params * tokens + attention
    return {"non_embedding_params": params, "flops": flops, "attention_share": attention / flops,
            "seconds": flops / (peak_tflops * 1e12)}


# --------------------------------------------------------------------------------------------------- main


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  {result['model']}  dtype {result['dtype']}  backend {result['backend']}  "
          f"batch_tokens {result['batch_tokens']}  criterion {result.get('criterion', 'threshold')}")
    print(f"{'corpus':10s}{'docs':>6s}{'tokens':>9s}{'e2e s':>8s}{'e2e t/s':>9s}{'steady t/s':>11s}{'fixed s':>8s}"
          f"{'padded t/s':>11s}{'steady/pad':>11s}{'prof/pad':>9s}{'batch-1 t/s':>12s}{'floor s':>8s}"
          f"{'peak GiB':>9s}")
    for name, c in result["corpora"].items():
        peak = c["build_peak_memory_gib"]
        print(f"{name:10s}{c['documents']:6d}{c['tokens']:9d}{c['e2e_seconds']:8.1f}{c['e2e_tokens_per_s']:9.0f}"
              f"{c['steady_tokens_per_s']:11.0f}{c['fixed_seconds']:8.1f}{c['padded_forward']['tokens_per_s']:11.0f}"
              f"{c['steady_over_padded']:11.2f}{c['profiler_over_padded']:9.2f}"
              f"{c['batch1_forward']['tokens_per_s']:12.0f}"
              f"{c['flop_floor']['seconds']:8.1f}{peak if peak is not None else float('nan'):9.1f}")
        if "reader_over_threshold" in c:
            r, t = c["profiler_in_process"], c["profiler_threshold_in_process"]
            print(f"{'':10s}in-process profiler: reader {r['seconds']:.2f} s ({r['forward_rows']} rows), threshold "
                  f"{t['seconds']:.2f} s ({t['forward_rows']} rows): {c['reader_over_threshold']:.2f}x")
        start = c["build_whole"]["last_build"].get("startup", {})
        print(f"{'':10s}start-up of the whole build: " + ", ".join(f"{k} {v:.1f} s" for k, v in start.items()))


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=("8b", "smollm2"), default=None,
                    help="default: 8b on cuda, smollm2 on cpu")
    ap.add_argument("--data", type=Path, default=None, help=f"{DATA_NAME} (default: shared/data or /work/shared/data)")
    ap.add_argument("--passages", type=int, default=None, help="default 3000 (cuda), 240 (cpu); 0: none")
    ap.add_argument("--chunks", type=int, default=None, help="default 256 (cuda), 0 (cpu)")
    ap.add_argument("--batch-tokens", type=int, default=32768, help="build.batch_tokens, and the padded baseline's budget")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="the device's dense bf16 rate, for the floor")
    ap.add_argument("--build-timeout", type=float, default=300.0, help="seconds one sift-build may take")
    ap.add_argument("--work", type=Path, default=None, help="folder for the model, corpora and indexes (a temp one)")
    ap.add_argument("--criterion", choices=("threshold", "reader"), default="threshold",
                    help="[profile] criterion of the builds and the in-process profiler")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch threads of the builds' actors (build.threads) and of this process's forwards")
    ap.add_argument("--only-build", action="store_true",
                    help="after the cold build, a fresh process's imports and Ray start (the floor under a build's "
                         "`imports` and `ray`), then one sift-build of each whole corpus and its start-up breakdown: "
                         "no half-corpus build, no forwards; writes build-start.json")
    args = ap.parse_args()
    device = "cpu" if args.smoke else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU visible: use --device cpu or --smoke")
    kind = "tiny" if args.smoke else args.model or ("8b" if device == "cuda" else "smollm2")
    gpu = device == "cuda"
    args.passages = args.passages if args.passages is not None else (12 if args.smoke else 3000 if gpu else 240)
    args.chunks = args.chunks if args.chunks is not None else (2 if args.smoke else 256 if gpu else 0)
    args.batch1_docs = {"passages": 500, "chunks": 64} if gpu else {}
    dtype = "bfloat16" if gpu else "float32"
    backend = "triton" if gpu else "torch"
    work = args.work or Path(tempfile.mkdtemp(prefix="sift-bench-build-"))
    work.mkdir(parents=True, exist_ok=True)

    model, model_cost = make_model(kind, device, work / "model")
    config = write_config(work / "build.toml", model, dtype, backend, args.batch_tokens, args.threads or 0,
                          args.criterion)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir() if model == DEFAULT_MODEL else model)
    texts = articles(find_data(args.data))
    chunk_tokens = 200 if args.smoke else CHUNK_TOKENS
    corpora = {}
    if args.passages:    # 0: no passage corpus (as --chunks 0)
        corpora["passages"] = passages(texts, args.passages)
    if args.chunks:
        corpora["chunks"] = chunks(texts, args.chunks, tokenizer, chunk_tokens)

    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import profiling_prefix_ids

    prefix = profiling_prefix_ids(tokenizer, ProfileConfig())
    # The first build on a machine compiles the Triton kernels into Triton's cache; later builds find them there.
    cold = build(write_corpus(work / "cold", passages(texts, 16)), work / "index-cold", config,
                 args.build_timeout)
    if args.only_build:
        m = machine_start()
        print("this machine, a fresh process: " + ", ".join(f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in m.items()))
        builds = {}
        for name, docs in corpora.items():
            builds[name] = build(write_corpus(work / name / "whole", docs), work / name / "index-whole", config,
                                 args.build_timeout)
            print_build(name, builds[name])
        write_result("build-start" if gpu else "build-start-cpu",
                     {"smoke": args.smoke, "model_kind": kind, "dtype": dtype, "backend": backend,
                      "batch_tokens": args.batch_tokens, "machine": m, "bytecode": bytecode(), "cold_build": cold,
                      "builds": builds,
                      "options": {k: str(v) for k, v in vars(args).items()}}, out_dir(args))
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        return
    results = {name: run_builds(name, docs, args, work, config) for name, docs in corpora.items()}
    # Then the forwards, the builds' actors gone: the same model loaded once in this process.
    model_obj, tok, _ = load_model(model, dtype=dtype, device=device, attn_implementation="sdpa")
    for name, docs in corpora.items():
        run_forwards(results[name], name, docs, model_obj, tok, args, dtype, device, prefix)
    result = {"smoke": args.smoke, "model": model if kind == "smollm2" else f"{kind}: Llama shape, random {dtype} "
              f"weights, SmolLM2 tokenizer", "model_kind": kind, "dtype": dtype, "backend": backend,
              "batch_tokens": args.batch_tokens, "tile": 64, "criterion": args.criterion,
              "peak_tflops": args.peak_tflops,
              "model_folder": model_cost, "bytecode": bytecode(), "cold_build": cold, "corpora": results,
              "options": {k: str(v) for k, v in vars(args).items()}}   # `args` is the argv (provenance)
    name = ("build" if gpu else "build-cpu") + ("-reader" if args.criterion == "reader" else "")
    path = write_result(name, result, out_dir(args))
    print_table(json.loads(path.read_text()))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


# What a fresh Python on this machine takes to import what a profiling actor imports, and to start a local Ray
# alone: the floor under a build's `imports` and `ray` (slow imports mean a slow file system or no bytecode cache).
MACHINE_START = """
import importlib.util, json, os, sys, time
# whether torch's bytecode is there before the import (beside the source, or under PYTHONPYCACHEPREFIX)
cached = os.path.exists(importlib.util.cache_from_source(importlib.util.find_spec("torch").origin))
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers
transformers.AutoModelForCausalLM
t2 = time.perf_counter()
import ray
ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
t3 = time.perf_counter()
ray.shutdown()
print(json.dumps({"import_torch": t1 - t0, "import_transformers": t2 - t1, "ray_start": t3 - t2,
                  "torch_bytecode_cached": cached}))
"""


def bytecode() -> dict:
    """Where the builds' Python processes (which inherit this one's environment) keep compiled bytecode: a Python
    environment without bytecode that may not write any recompiles every module it imports in every process
    (about 10 s more per process for torch and transformers), which shows in a build's `ray`, `imports` and `plan`."""
    return {"pycache_prefix": sys.pycache_prefix, "writes_bytecode": not sys.dont_write_bytecode}


def machine_start() -> dict:
    """`MACHINE_START` in a fresh process -> its seconds, and whether torch's bytecode was cached when it started."""
    proc = subprocess.run([sys.executable, "-c", MACHINE_START], capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def print_build(name: str, b: dict) -> None:
    """One build's wall time from outside, its own seconds and its start-up breakdown (`--only-build`)."""
    last = b["last_build"]
    print(f"{name}: {b['documents']} documents, {b['tokens']} tokens: end to end {b['wall_seconds']:.1f} s, build "
          f"{last['seconds']:.1f} s, actor compute {last['actor_seconds']:.1f} s")
    print("  start-up: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(last["startup"].items(), key=lambda kv: kv[1])))


def streaming_rate(b: dict) -> float:
    """A build's steady state: its tokens over the seconds from the moment its slowest actor could profile to
    the last shard written (`last_build.startup`), the start-up excluded. A fit over two corpus sizes
    (`two_size_fit_tokens_per_s`) excludes it too, but carries the difference of two builds' start-ups, which
    on small corpora is as large as their difference in profiling time: it has come out above the actors' own
    compute rate, which no build can exceed."""
    startup = b["last_build"]["startup"]
    seconds = startup["last_shard"] - startup["actor_ready"]
    return b["tokens"] / seconds if seconds > 0 else float("nan")


def run_builds(name: str, docs: list[str], args, work: Path, config: Path) -> dict:
    """The corpus built twice by `sift-build`, its first half and whole: end-to-end and steady-state rates."""
    out = {"documents": len(docs)}
    out["build_half"] = build(write_corpus(work / name / "half", docs[: len(docs) // 2]), work / name / "index-half",
                              config, args.build_timeout)
    out["build_whole"] = build(write_corpus(work / name / "whole", docs), work / name / "index-whole", config,
                               args.build_timeout)
    w, h = out["build_whole"], out["build_half"]
    extra_tokens, extra_seconds = w["tokens"] - h["tokens"], w["wall_seconds"] - h["wall_seconds"]
    fit = extra_tokens / extra_seconds if extra_seconds > 0 else float("nan")
    steady = streaming_rate(w)
    peaks = [n["peak_memory_gib"] for n in w["last_build"]["nodes"].values() if "peak_memory_gib" in n]
    out.update(tokens=w["tokens"], mean_tokens=w["tokens"] / len(docs), e2e_seconds=w["wall_seconds"],
               e2e_tokens_per_s=w["tokens"] / w["wall_seconds"], steady_tokens_per_s=steady,
               two_size_fit_tokens_per_s=fit, fixed_seconds=w["wall_seconds"] - w["tokens"] / steady,
               actor_tokens_per_s=w["tokens"] / max(w["last_build"]["actor_seconds"], 1e-9),
               build_peak_memory_gib=max(peaks) if peaks else None)
    return out


def run_forwards(out: dict, name: str, docs: list[str], model_obj, tok, args, dtype, device, prefix) -> None:
    """The same documents through the same model in this process (no build running: the device is free)."""
    ids = [tok(d, add_special_tokens=False).input_ids for d in docs]
    seqs = [prefix + i for i in ids]
    model_obj.set_attn_implementation("sdpa")
    b1 = batch1_forward(model_obj, seqs[: args.batch1_docs.get(name, len(seqs))], device)
    b1["whole_corpus_seconds_extrapolated"] = sum(len(s) for s in seqs) / b1["tokens_per_s"]
    out["batch1_forward"] = b1
    # The builder's steady state without Ray: its profiler on the same documents in this process, after a padded
    # forward and, on a CPU (a machine others may share), before another one, so load moves both alike.
    padded = [padded_forward(model_obj, seqs, device, args.batch_tokens)]
    out["profiler_in_process"] = profile_in_process(model_obj, tok, ids, dtype, device, args.batch_tokens,
                                                    args.criterion)
    if args.criterion == "reader":
        out["profiler_threshold_in_process"] = profile_in_process(model_obj, tok, ids, dtype, device,
                                                                  args.batch_tokens)
        out["reader_over_threshold"] = (out["profiler_in_process"]["seconds"]
                                        / out["profiler_threshold_in_process"]["seconds"])
    if device == "cpu":
        model_obj.set_attn_implementation("sdpa")
        padded.append(padded_forward(model_obj, seqs, device, args.batch_tokens))
    out["padded_forward"] = min(padded, key=lambda r: r["seconds"])
    out["padded_forward"]["runs_tokens_per_s"] = [r["tokens_per_s"] for r in padded]
    out["steady_over_padded"] = out["steady_tokens_per_s"] / out["padded_forward"]["tokens_per_s"]
    out["profiler_over_padded"] = (out["profiler_in_process"]["tokens_per_s"]
                                   / out["padded_forward"]["tokens_per_s"])
    out["flop_floor"] = flop_floor(model_obj, seqs, args.peak_tflops)
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)})}", flush=True)


if __name__ == "__main__":
    main()
