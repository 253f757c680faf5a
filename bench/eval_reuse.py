"""What document KV reuse costs in answers: dense, sift, reuse and each hybrid recovery policy on the same
questions with the real SmolLM2-135M-Instruct, greedy, scored against dense and the gold answers.

Three sets (bench/qa_sets.py): hotpotqa (10 paragraphs of ~130 tokens per question), 2wiki (2WikiMultihopQA
dev, 10 paragraphs of ~90 tokens) and long (gold paragraphs and a distractor inside ~1-1.5K-token documents).

Per set: the questions' documents are written as a corpus (`quality.qa.write_corpus`) and indexed with the
`sift-build` CLI in a subprocess (default profile thresholds, tile --tile, 16 by default so that ~130-token
paragraphs have tiles to skip; the config TOML is written next to the index), or an existing index is reused
(--index, one set only). Then every mode runs on every question through `quality.eval.evaluate`, one
question per call (batch 1; the call warms each mode up on its question first, which keeps one-off costs out of
TTFT and lets the result be written after every question), with one KVStore for the whole set (--store-gib,
large enough to hold every document): a question's documents are in the store after the first reuse mode's
warm-up, so every timed reuse / hybrid run is warm. The reuse modes give the same logits warm or cold
(tests/test_kv_reuse.py), so the store's state changes TTFT only.

Modes: dense (the reference), sift, reuse, hybrid:first (EPIC-like), hybrid:deviation (CacheBlend-like),
hybrid:bits (the index's CA bits), hybrid:none (a check: must equal reuse token for token on every question, else
the script exits with status 1 after writing its result). Each policy runs at
each budget of --hybrid-fractions (mode "hybrid:<policy>@<fraction>": that share of each reused document's
blocks, at least one, recomputed in the request's context).

Per mode: agreement with dense (first token, whole answer), EM / F1 / gold containment, KL of the first-token
distribution, tile fraction, the share of the documents' tokens recomputed in context (`recomputed_fraction`:
1 for dense and sift, which compute every document in context), TTFT; each the mean over questions with a 95%
percentile-bootstrap interval. Writes bench/results/eval_reuse.json (after each question) and prints a
Markdown table per set. On CPU the sparse modes apply their pattern as a mask over dense attention and decode
through the kernels' ref twins, so TTFT there measures correctness paths, not speed.

    python bench/eval_reuse.py [--sets hotpotqa,2wiki,long] [--limit-hotpotqa 40] [--limit-2wiki 40]
                               [--limit-long 15] [--hybrid-fractions 0.15,0.3,0.5]
    python bench/eval_reuse.py --sets hotpotqa --index DIR   # an index of the questions' paragraphs
    python bench/eval_reuse.py --smoke     # 2 questions per set, 4 new tokens: checks the script runs

--modes replaces the mode list (dense is always run), e.g. the reuse corrections `auto@<f>:<t>` and
`ape@<T>:<S>` (runtime/reuse.py; an index built here with --model-dir then holds each document's
context_sensitivity, which `auto` reads). --held-in N reports each set's first N evaluated questions (where
settings are chosen) apart from the others and prints the held-out figures of the mode the held-in questions
choose among those recomputing at most --budget of the documents' tokens; --start N skips each set's first N
questions. --no-warmup and --threads 1 suit answer-only runs on a shared CPU. --batch B runs B questions per
engine call (prefilled together, decoded in one continuous batch): a question's answers are its own, but its
tile fraction, share recomputed and TTFT are then its batch's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import common  # bench/common.py (the script's folder is on sys.path)
import qa_sets  # bench/qa_sets.py

import torch  # noqa: E402

from sift.errors import SiftError  # noqa: E402
from sift.runtime import KVStore, SiftEngine, SiftIndex  # noqa: E402
from sift.quality.eval import aggregate, cell, evaluate, summarise  # noqa: E402
from sift.quality.qa import QAItem, write_corpus  # noqa: E402

from qa_sets import SETS, SHARED  # noqa: E402
POLICIES = ("first", "deviation", "bits")


def modes_of(fractions: list[float], policies=POLICIES) -> tuple[str, ...]:
    """dense, sift, reuse, each policy at each budget ("hybrid:<policy>@<fraction>"), and hybrid:none."""
    hybrid = [f"hybrid:{p}@{f:g}" for f in fractions for p in policies]
    return ("dense", "sift", "reuse", *hybrid, "hybrid:none")


def hybrid_modes(modes) -> list[str]:
    """The modes that reuse documents' KV and recover some of what it costs (every mode but dense, sift, reuse
    and hybrid:none)."""
    return [m for m in modes if m not in ("dense", "sift", "reuse", "hybrid:none")]


def parse_args():
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="hotpotqa,2wiki,long", help=f"comma-separated QA sets among {', '.join(SETS)}")
    ap.add_argument("--limit-hotpotqa", type=int, default=40, help="questions of the hotpotqa set")
    ap.add_argument("--limit-long", type=int, default=15, help="questions of the long-document set")
    ap.add_argument("--limit-2wiki", type=int, default=40, help="questions of the 2wiki set")
    ap.add_argument("--limit-nq-long", type=int, default=15, help="questions of the NQ long-document set")
    ap.add_argument("--doc-chars", type=int, default=5400, help="characters per long document")
    ap.add_argument("--hotpotqa-json", type=Path, default=SHARED / "hotpotqa_train.json",
                    help="official HotpotQA JSON the long set is built from")
    ap.add_argument("--nq-json", type=Path, default=SHARED / "nq-open-oracle.jsonl.gz",
                    help="NaturalQuestions-open oracle file the nq-long set is built from")
    ap.add_argument("--wiki", type=Path, default=SHARED / "wiki_vital_summaries_en.json.gz",
                    help="Wikipedia vital-article leads the long set embeds paragraphs in")
    ap.add_argument("--index", type=Path, default=None, help="an existing index of the set's documents "
                    "(only with one set in --sets); default: build one under --work")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sift-eval-reuse"),
                    help="folder for the corpora and indexes built (updated incrementally by sift-build)")
    ap.add_argument("--tile", type=int, default=16, help="tile of the indexes built")
    ap.add_argument("--profile-prefix", choices=("bos", "system"), default="bos",
                    help="the profiling prefix of the indexes built (the context every stored document is computed "
                         "after): the tokenizer's BOS token (the builder's default) or the prompts' own system "
                         "prompt")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated hybrid policies to run")
    ap.add_argument("--hybrid-fractions", default="0.15", help="comma-separated budgets: each hybrid policy "
                    "runs at each share of each document's blocks recomputed")
    ap.add_argument("--modes", dest="modes_text", default=None, help="comma-separated modes to run instead of the default list "
                    "(dense is always run, as the reference), e.g. sift,reuse,ape@0.9:0.9")
    ap.add_argument("--start", type=int, default=0, help="skip each set's first N questions (held-out runs: "
                    "questions N+1 .. N+limit)")
    ap.add_argument("--no-warmup", action="store_true", help="do not warm each mode up before its timed run "
                    "(answers only: TTFT then includes one-off costs)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--batch", type=int, default=1, help="questions per engine call: each mode prefills and "
                    "decodes them together (tile fraction, recompute share and TTFT are then the batch's)")
    ap.add_argument("--held-in", type=int, default=0, help="report the first N evaluated questions of each set "
                    "(held in: where modes' settings are chosen) apart from the others (held out), and the held-out "
                    "figures of the mode the held-in questions choose")
    ap.add_argument("--budget", type=float, default=0.3, help="the most documents' tokens a mode chosen on the "
                    "held-in questions may recompute")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--store-gib", type=float, default=4.0, help="KV store budget (host memory on CPU)")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of each interval")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels)")
    ap.add_argument("--block", type=int, default=None, help="kernel block (default: the tile, as on CPU)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a plain transformers folder of the default model (where the GGUF package is not "
                         "installed); the index is then built in this process (Profiler, no Ray)")
    args = ap.parse_args()
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    bad = [s for s in args.sets if s not in SETS]
    if not args.sets or bad:
        ap.error(f"--sets {bad or '(empty)'}: each set must be one of {', '.join(SETS)}")
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: give at least 1")
    if args.index is not None and len(args.sets) != 1:
        ap.error("--index names one set's index: give exactly one set in --sets")
    try:
        args.fractions = [float(f) for f in args.hybrid_fractions.split(",") if f.strip()]
    except ValueError:
        args.fractions = []
    if not args.fractions or not all(0.0 <= f <= 1.0 for f in args.fractions):
        ap.error(f"--hybrid-fractions {args.hybrid_fractions!r}: give comma-separated shares in [0, 1]")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policies or not set(args.policies) <= set(POLICIES):
        ap.error(f"--policies {args.policies}: each must be one of {', '.join(POLICIES)}")
    args.modes = modes_of(args.fractions, args.policies)
    if args.modes_text is not None:
        listed = [m.strip() for m in args.modes_text.split(",") if m.strip()]
        args.modes = tuple(dict.fromkeys(["dense", *listed]))
    if args.smoke:
        args.limit_hotpotqa, args.limit_long, args.limit_2wiki, args.max_new_tokens, args.resamples = 2, 2, 2, 4, 200
        args.limit_nq_long = 2
    return args


# ------------------------------------------------------------------------------------------- questions, index


def load_set(name: str, args) -> list[QAItem]:
    """Questions start+1 .. start+limit of the set."""
    limit = args.start + getattr(args, "limit_" + name.replace("-", "_"))
    return qa_sets.load_set(name, limit, hotpotqa_json=args.hotpotqa_json, wiki=args.wiki, doc_chars=args.doc_chars,
                            nq_json=args.nq_json)[args.start:]


def prefix_text(args) -> str | None:
    """The builder's `prefix_text` for --profile-prefix (None: its default, the BOS token)."""
    from sift.quality.prompts import SYSTEM

    return SYSTEM if args.profile_prefix == "system" else None


def build_index_in_process(items: list[QAItem], folder: Path, tile: int, model, tokenizer, model_dir: Path,
                           prefix: str | None = None, sensitivity: bool = False) -> Path:
    """The same index built here, without Ray (bench/qa_sets.py); sensitivity: with the documents'
    context_sensitivity (mode "auto" reads it)."""
    from sift.pipeline.config import ProfileConfig

    docs = {}
    for item in items:
        for doc_id, text in item.docs:
            docs.setdefault(doc_id, text)
    return qa_sets.build_in_process(docs, folder / "index", ProfileConfig(tile=tile, prefix_text=prefix), model,
                                    tokenizer, model_dir, profile_key="eval_reuse", sensitivity=sensitivity)


def build_index(items: list[QAItem], folder: Path, tile: int, prefix: str | None = None) -> Path:
    """Write the questions' documents as a corpus and (incrementally) index them with `sift-build`."""
    corpus = folder / "corpus" / "docs.jsonl"
    conflicts = write_corpus(items, corpus)
    if conflicts:
        print(f"  {len(conflicts)} doc_ids with two texts keep their first (later questions are skipped)")
    config = folder / "config.toml"
    lines = f'model = "smollm2-135m-instruct"\n\n[profile]\ntile = {tile}\n'
    if prefix is not None:
        lines += f"prefix_text = {json.dumps(prefix)}\n"   # a JSON string is a TOML basic string
    config.write_text(lines)
    index = folder / "index"
    cmd = [str(Path(sys.executable).with_name("sift-build")), str(corpus.parent), "--out", str(index),
           "--config", str(config), "-q"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout.rstrip())
    if proc.returncode != 0:
        raise SiftError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode} (its output is above)")
    print(f"  index {index} built in {time.perf_counter() - t:.0f} s", flush=True)
    return index


# ------------------------------------------------------------------------------------------------- running


def _key(mode: str, request) -> tuple:
    return mode, request.prefix, tuple(doc_id for doc_id, _ in request.docs), request.query


def record_generations(engine: SiftEngine) -> dict:
    """Wrap engine.generate (on this instance) to keep what the eval's rows lack: per (mode, request) of a
    one-request call, the share of documents' tokens recomputed, the store's hits and the generated ids."""
    seen: dict[tuple, dict] = {}
    generate = engine.generate

    def recording(requests, max_new_tokens=32, mode="sift"):
        out = generate(requests, max_new_tokens, mode=mode)
        for i, request in enumerate(requests):
            seen[_key(mode, request)] = dict(recomputed_fraction=out.prefill.recomputed_fraction,
                                             store=dict(out.prefill.store), token_ids=list(out.token_ids[i]))
        return out

    engine.generate = recording
    return seen


def run_set(name: str, items: list[QAItem], index_path: Path, model, tokenizer, args, write) -> dict:
    """Evaluate the set --batch questions at a time (`quality.eval.evaluate` per batch, which warms each mode up
    first), calling write(result so far) after each, so that a long run leaves its partial result behind."""
    index = SiftIndex.open(index_path, device=args.device)
    store = KVStore(hbm_bytes=int(args.store_gib * 2**30), dram_bytes=0)
    engine = SiftEngine(model, tokenizer, index, kv_store=store, block=args.block or args.tile)
    seen = record_generations(engine)
    rows, skipped, none_equals_reuse = [], [], []
    t = time.perf_counter()
    for start in range(0, len(items), args.batch):
        chunk = items[start:start + args.batch]
        r, s = evaluate(engine, chunk, args.modes, batch=len(chunk), max_new_tokens=args.max_new_tokens,
                        warmup=not args.no_warmup)
        skipped += s
        requests = {item.id: item.request() for item in chunk}
        for row in r:
            request = requests[row["id"]]
            for mode in args.modes:
                extra = seen[_key(mode, request)]
                row["modes"][mode]["recomputed_fraction"] = extra["recomputed_fraction"]
                row["modes"][mode]["store"] = extra["store"]
            if {"hybrid:none", "reuse"} <= set(args.modes):
                none_equals_reuse.append(seen[_key("hybrid:none", request)]["token_ids"]
                                         == seen[_key("reuse", request)]["token_ids"])
        rows += r
        print(f"  {name}: {start + len(chunk)}/{len(items)} questions ({time.perf_counter() - t:.0f} s)", flush=True)
        write(_result(rows, skipped, none_equals_reuse, len(items), index, engine, store, args,
                      time.perf_counter() - t))
    return _result(rows, skipped, none_equals_reuse, len(items), index, engine, store, args, time.perf_counter() - t)


def _aggregate(rows, args) -> dict:
    modes = aggregate(rows, args.modes, resamples=args.resamples)
    for mode in args.modes:
        modes[mode]["recomputed_fraction"] = summarise([r["modes"][mode]["recomputed_fraction"] for r in rows],
                                                       resamples=args.resamples)
    return modes


def _result(rows, skipped, none_equals_reuse, questions, index, engine, store, args, seconds) -> dict:
    split = {}
    if args.held_in:    # the questions settings are chosen on, and the others, which report them
        split = dict(held_in=_aggregate(rows[:args.held_in], args), held_out=_aggregate(rows[args.held_in:], args))
    return dict(questions=questions, evaluated=len(rows), index=str(index.path), tile=index.tile,
                documents=len(index), block=engine.block, backend=engine.backend,
                mean_prompt_tokens=sum(r["n_tokens"] for r in rows) / max(1, len(rows)),
                hybrid_none_equals_reuse=f"{sum(none_equals_reuse)}/{len(none_equals_reuse)}",
                store=store.stats(), seconds=seconds, modes=_aggregate(rows, args), rows=rows, skipped=skipped,
                **split)


# -------------------------------------------------------------------------------------------------- report

COLUMNS = (("agreement_first_token", "first token = dense", "{:.0%}"),
           ("agreement_answer", "answer = dense", "{:.0%}"), ("em", "EM", "{:.0%}"), ("f1", "F1", "{:.2f}"),
           ("containment", "gold contained", "{:.0%}"), ("tile_fraction", "tiles computed", "{:.1%}"),
           ("recomputed_fraction", "doc tokens recomputed", "{:.1%}"), ("ttft_s", "TTFT s", "{:.2f}"))


def verdict(modes: dict) -> str:
    """Which hybrid mode agrees best with dense (whole answer, then first token), whether it agrees at least as
    often as sift, and the cheapest mode that does (fewest documents' tokens recomputed)."""
    score = lambda m: (modes[m]["agreement_answer"]["mean"], modes[m]["agreement_first_token"]["mean"])  # noqa
    hybrid = hybrid_modes(modes)
    if not hybrid or "sift" not in modes:
        return "no recovering reuse mode, or no sift, to compare"
    best = max(hybrid, key=score)
    (answer, first), (sift_answer, sift_first) = score(best), score("sift")
    enough = [m for m in hybrid if score(m)[0] >= sift_answer]
    cheapest = min(enough, key=lambda m: modes[m]["recomputed_fraction"]["mean"], default=None)
    line = (f"best hybrid mode: {best} (answer = dense {answer:.0%}, first token {first:.0%}); sift: "
            f"{sift_answer:.0%} / {sift_first:.0%}; a hybrid mode agrees with dense at least as often as sift: "
            f"{'yes' if enough else 'no'}")
    if cheapest:
        line += (f" (the cheapest: {cheapest}, {modes[cheapest]['recomputed_fraction']['mean']:.0%} of documents' "
                 f"tokens recomputed)")
    return line


def markdown(name: str, res: dict, args) -> str:
    lines = [f"### {name}: {res['evaluated']} of {res['questions']} questions, {res['documents']} documents, "
             f"mean prompt {res['mean_prompt_tokens']:.0f} tokens, tile {res['tile']}, block {res['block']}, "
             f"backend {res['backend']}, hybrid budgets {args.hybrid_fractions}, {args.max_new_tokens} new "
             f"tokens, greedy; mean [95% bootstrap interval]", "",
             "| mode | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for mode, stats in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(cell(stats[key], fmt) for key, _, fmt in COLUMNS) + " |")
    lines += ["", (f"hybrid:none equals reuse token for token on {res['hybrid_none_equals_reuse']} questions; "
                   if "hybrid:none" in res["modes"] else "") + verdict(res["modes"])]
    if res.get("held_out") and res["held_out"]["dense"]["n"]:
        lines += ["", f"held out (questions after the first {args.held_in} evaluated):", "",
                  "| mode | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
        for mode, stats in res["held_out"].items():
            lines.append(f"| {mode} | " + " | ".join(cell(stats[key], fmt) for key, _, fmt in COLUMNS) + " |")
        lines += ["", chosen_on_held_in(res, args.budget)]
    if res["skipped"]:
        lines += [f"skipped {len(res['skipped'])}: " + "; ".join(f"{s['id']}: {s['reason']}"
                                                              for s in res["skipped"])]
    return "\n".join(lines) + "\n"


def chosen_on_held_in(res: dict, budget: float) -> str:
    """The recovering reuse mode with the best held-in agreement (whole answer, then first token, then the lower
    first-token KL) among those recomputing at most `budget` of the documents' tokens, and its held-out figures
    beside sift's."""
    held_in, held_out = res["held_in"], res["held_out"]
    fits = [m for m in hybrid_modes(held_in) if held_in[m]["recomputed_fraction"]["mean"] <= budget]
    if not fits:
        return f"no recovering reuse mode recomputes at most {budget:.0%} of the documents' tokens"
    key = lambda m: (held_in[m]["agreement_answer"]["mean"], held_in[m]["agreement_first_token"]["mean"],  # noqa
                     -held_in[m]["kl_first_token"]["mean"])
    best = max(fits, key=key)
    out = held_out[best]
    line = (f"chosen on held-in (at most {budget:.0%} recomputed): {best}; held out: answer = dense "
            f"{out['agreement_answer']['mean']:.0%}, first token {out['agreement_first_token']['mean']:.0%}, "
            f"{out['recomputed_fraction']['mean']:.0%} recomputed")
    if "sift" in held_out:
        line += f"; sift held out: answer = dense {held_out['sift']['agreement_answer']['mean']:.0%}"
    return line


def main() -> None:
    args = parse_args()
    from sift.model import DEFAULT_MODEL, load_model

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir is None:
        model, tokenizer, _ = load_model(DEFAULT_MODEL, device=args.device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation="sdpa")
        model = model.to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    settings = dict(model=DEFAULT_MODEL, device=args.device, block=args.block or args.tile, modes=list(args.modes),
                    batch=args.batch,
                    hybrid_fractions=args.fractions, max_new_tokens=args.max_new_tokens, tile=args.tile,
                    profile_prefix=args.profile_prefix,
                    store_gib=args.store_gib, doc_chars=args.doc_chars,
                    limits={name: getattr(args, "limit_" + name.replace("-", "_")) for name in args.sets},
                    ci=dict(method="percentile bootstrap of the mean", level=0.95, resamples=args.resamples),
                    command=" ".join(["python", "bench/eval_reuse.py", *sys.argv[1:]]))
    results, tables, checks = {}, [], common.Checks()
    for name in args.sets:
        items = load_set(name, args)
        print(f"{name}: {len(items)} questions", flush=True)
        if args.index:
            index = args.index
        elif args.model_dir is not None:
            index = build_index_in_process(items, args.work / name, args.tile, model, tokenizer, args.model_dir,
                                           prefix_text(args), sensitivity=any(m.startswith("auto") for m in args.modes))
        else:
            index = build_index(items, args.work / name, args.tile, prefix_text(args))

        def write(partial: dict) -> None:
            results[name] = dict(settings=settings, **partial)
            common.write_result("eval_reuse", dict(sets=results), common.out_dir(args))

        write(run_set(name, items, index, model, tokenizer, args, write))
        tables.append(markdown(name, results[name], args))
        if {"hybrid:none", "reuse"} <= set(args.modes):
            same, n = map(int, results[name]["hybrid_none_equals_reuse"].split("/"))
            checks.true(f"{name}/hybrid_none_equals_reuse", same == n, f"token for token on {same} of {n} questions")
    print("\n" + "\n".join(tables))
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    common.run_main(main)
