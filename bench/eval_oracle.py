"""How many blocks must a per-document index compute for sparse answers to agree with dense? The in-context
oracle (quality/oracle.py: the bits of SIFT's format chosen from each prompt's own exact attention, losing at most
1 - C of the document rows' attention mass per (layer, head)) at several coverages C, beside an index's bits
(--setting, default the paper's thresholds) and dense, on the same questions in one run.

For each set of bench/qa_sets.py, questions --first..--limit-<set> are evaluated with `sift-eval`'s `run`
(modes dense, sift and oracle@C for each C of --coverages) over an index of their documents built in this process
with --setting (bench/qa_sets.py `build_in_process`). Per mode: whole-answer and first-token agreement with dense
(95% bootstrap intervals), gold containment and the tiles computed (the engine's (head, query block, key block)
triples over dense, at its kernel block; the oracle's tile is the block, so it computes exactly what it chose).

Writes bench/results/eval_oracle.json: `sets["<set>/<dtype>"]` (`"<set>/<dtype>/<tag>"` with --tag) with the run (command, date, device), the
questions, the setting, each mode's summary and each question's agreement per mode; other keys already in the
file are kept.

    python bench/eval_oracle.py --device cuda --model-dir DIR [--dtype float32] [--sets long,nq-long] [--first 41]
                                [--limit-long 100] [--limit-nq-long 100] [--coverages 0.999,0.998,0.995,0.99]
                                [--readers 0.997,0.995] [--setting tile=64] [--max-new-tokens 16] [--tag T]
    python bench/eval_oracle.py --smoke     # 2 questions of one set, one coverage, 2 tokens: checks it runs
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import common  # bench/common.py (the script's folder is on sys.path)
import qa_sets  # bench/qa_sets.py
from eval_quality import InProcessBuilder  # bench/eval_quality.py

import torch  # noqa: E402

from sift.quality.calibrate import parse_setting  # noqa: E402
from sift.quality.eval import run as run_eval  # noqa: E402
from sift.quality.qa import write_corpus, write_qa  # noqa: E402


def parse_args():
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="long,nq-long", help="comma-separated QA sets")
    ap.add_argument("--first", type=int, default=41, help="first question evaluated (1-based)")
    for name, default in (("hotpotqa", 100), ("2wiki", 200), ("long", 100), ("nq-long", 100)):
        ap.add_argument(f"--limit-{name}", type=int, default=default, help=f"last question of the {name} set")
    ap.add_argument("--coverages", default="0.999,0.998,0.995,0.99",
                    help="comma-separated C: the oracle keeps at least C of each (layer, head)'s document-row mass")
    ap.add_argument("--readers", default="",
                    help="comma-separated C: also the reader criterion reader@C (each document's bits chosen from "
                         "its own attention and a fixed reader text after it)")
    ap.add_argument("--setting", default="tile=64", help="the index's profile (sift-calibrate --setting syntax)")
    ap.add_argument("--tag", default="", help="stored as sets[\"<set>/<dtype>/<tag>\"] (a run beside the main one)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32", help="serving and profiling dtype")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels)")
    ap.add_argument("--block", type=int, default=None, choices=(16, 32, 64, 128),
                    help="kernel block (default: 128 on CUDA, the index tile on CPU)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a plain transformers folder of the default model (where the GGUF package is not installed)")
    ap.add_argument("--hotpotqa-json", type=Path, default=qa_sets.SHARED / "hotpotqa_train.json")
    ap.add_argument("--wiki", type=Path, default=qa_sets.SHARED / "wiki_vital_summaries_en.json.gz")
    ap.add_argument("--nq-json", type=Path, default=qa_sets.SHARED / "nq-open-oracle.jsonl.gz")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sift-eval-oracle"), help="indexes and QA files")
    args = ap.parse_args()
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not args.sets or not set(args.sets) <= set(qa_sets.SETS):
        ap.error(f"--sets {args.sets}: each must be one of {', '.join(qa_sets.SETS)}")
    args.coverages = [float(x) for x in args.coverages.split(",") if x.strip()]
    args.readers = [float(x) for x in args.readers.split(",") if x.strip()]
    if args.smoke:
        args.sets, args.first, args.max_new_tokens, args.coverages = args.sets[:1], 1, 2, args.coverages[:1]
        args.limit_hotpotqa = args.limit_2wiki = args.limit_long = args.limit_nq_long = 2
    return args


def summary(report: dict) -> dict:
    """sift-eval's report -> per mode: n and the means (with intervals) that matter here; per question, the
    whole-answer agreement and tiles of each mode."""
    keep = ("agreement_answer", "agreement_first_token", "containment", "kl_first_token", "tile_fraction")
    modes = {mode: dict(n=stats["n"], **{k: stats[k] for k in keep}) for mode, stats in report["modes"].items()}
    rows = [dict(id=r["id"], **{m: dict(agree=v["agreement_answer"], tiles=round(v["tile_fraction"], 5))
                                for m, v in r["modes"].items()}) for r in report["rows"]]
    return dict(modes=modes, rows=rows, skipped=report["skipped"])


def main() -> None:
    args = parse_args()
    from sift.model import DEFAULT_MODEL

    torch.manual_seed(0)
    model = str(args.model_dir) if args.model_dir is not None else DEFAULT_MODEL
    builder = InProcessBuilder(args.model_dir, args.device, args.dtype)
    setting = parse_setting(args.setting)
    modes = ["dense", "sift", *(f"oracle@{c:g}" for c in args.coverages), *(f"reader@{c:g}" for c in args.readers)]
    run = dict(model=DEFAULT_MODEL, device=args.device, setting=args.setting, coverages=args.coverages,
               readers=args.readers,
               max_new_tokens=args.max_new_tokens, block=args.block,
               command=" ".join(["python", "bench/eval_oracle.py", *sys.argv[1:]]))
    path = common.out_dir(args) / "eval_oracle.json"
    results = json.loads(path.read_text()).get("sets", {}) if path.exists() else {}
    lines = []
    for name in args.sets:
        limit = getattr(args, "limit_" + name.replace("-", "_"))
        items = qa_sets.load_set(name, limit, hotpotqa_json=args.hotpotqa_json, wiki=args.wiki,
                                 nq_json=args.nq_json)[args.first - 1:]
        work = args.work / name
        write_corpus(items, work / "corpus" / "docs.jsonl")
        builder(setting, work / "corpus", work / "index", model)
        qa = work / "qa.jsonl"
        write_qa(items, qa)
        print(f"{name}: questions {args.first}-{limit}, modes {', '.join(modes)}", flush=True)
        t = time.perf_counter()
        report = run_eval(work / "index", qa, modes=modes, model=model, max_new_tokens=args.max_new_tokens,
                          device=args.device, dtype=args.dtype, block=args.block, items=items,
                          echo=lambda m: print("  " + m, flush=True))
        result = dict(questions=[args.first, limit], setting=dataclasses.asdict(setting),
                      dtype=report["settings"]["dtype"], block=report["settings"]["block"],
                      seconds=time.perf_counter() - t, **summary(report))
        key = "/".join([name, result["dtype"], *([args.tag] if args.tag else [])])
        results[key] = dict(run=dict(run, **common.environment()), **result)
        common.write_result("eval_oracle", dict(sets=results), common.out_dir(args))
        for mode, s in result["modes"].items():
            lo, hi = s["agreement_answer"]["ci95"]
            lines.append(f"{name} {mode:<14} answer = dense {s['agreement_answer']['mean']:.0%} [{lo:.0%}, {hi:.0%}]"
                         f"  first token {s['agreement_first_token']['mean']:.0%}  tiles "
                         f"{s['tile_fraction']['mean']:.1%}  (n={s['n']})")
    print("\n".join(lines))


if __name__ == "__main__":
    common.run_main(main)
