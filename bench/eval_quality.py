"""What SIFT's sparsity costs in answers, per QA set: `sift-calibrate`'s sweep, Pareto front, choice and held-out
evaluation, and the floor of the agreement measure, on the real SmolLM2-135M-Instruct.

For each set of bench/qa_sets.py (hotpotqa, 2wiki, long, nq-long) the first --held-in questions are held in and the next
ones, up to --limit-<set>, held out. `quality.calibrate.calibrate_items` then

1. builds an index of the held-in documents for every setting of --settings (indexes built in this process with
   the builder's Profiler and writers: bench/qa_sets.py `build_in_process`, no Ray) and measures whole-answer
   and first-token agreement of `sift` with `dense` and the tiles computed (the engine's (head, query block, key
   block) triples over dense, at the engine's kernel block: --block, else 128 on CUDA and the index tile on CPU);
2. draws the Pareto front and chooses the sparsest setting meeting --target-agreement on the held-in questions;
3. evaluates the chosen setting, the paper's defaults (tile 64, alpha 0.001, beta 0.01, gamma 0.1) and every
   other setting of the held-in front (--held-out-all: every swept setting) on the held-out questions
   (sift-eval's report: agreement with 95% bootstrap intervals, gold containment, F1, KL);
4. measures the floor: the engine's dense answers against greedy answers of the same weights through
   transformers' own attention (SDPA), at the serving dtype and at the other of float32 / bfloat16.

With --guard-ca, each setting's guarded twins are swept beside it (`quality.calibrate.guard`: CA pages kept
whole in the layers, or with --guard-by head the (layer, head) pairs, whose document rows lose more than eps of
their attention mass on dropped CA pages, measured on --guard-prompts held-in prompts; --guard-at-block counts
the pages as the engine's kernel block computes them).

Each set's result also names the setting the held-in questions choose at no more tiles than the paper's
defaults compute (`within_default_tiles`: the best held-in agreement among them, with its held-out figures
when --held-out-within-default, --held-out-all or the front put it there).

Writes bench/results/eval_quality.json: `sets["<set>/<dtype>"]` (`"<set>/<dtype>/<tag>"` with --tag), each
set's front.json content with the run that produced it (command, date, device), written after the sweep, after
each held-out setting (`complete` false) and when the set is done (`complete` true); entries
of other keys already in the file are kept, so runs per dtype, per set or per tag add up to one result. Under
--work, each set's calibration folder (front.png, held-out reports, calibrated.toml when a setting met the
target).

    python bench/eval_quality.py --device cuda --model-dir DIR [--sets hotpotqa,2wiki,long,nq-long] [--held-in 25]
                                 [--limit-long 100] [--limit-nq-long 100] [--dtype bfloat16] [--max-new-tokens 16]
                                 [--guard-ca 0.04,0.03] [--guard-by layer,head] [--guard-at-block] [--no-floor]
                                 [--held-out-all] [--block B] [--tag T] [--batch B]
                                 [--held-out-within-default] [--kv-gib G]
    python bench/eval_quality.py --smoke     # 3 questions of one set, 2 settings, 2 tokens: checks it runs
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import common  # bench/common.py (the script's folder is on sys.path)
import qa_sets  # bench/qa_sets.py

import torch  # noqa: E402

from sift.quality.calibrate import DEFAULT, GUARD_BY, calibrate_items, parse_setting, within_tiles  # noqa: E402

SETTINGS = ("tile=64", "tile=32", "tile=16",
            "tile=16,alpha=0.003,beta=0.02,gamma=0.2",
            "tile=32,alpha=0.0003,beta=0.003,gamma=0.03",
            "tile=16,alpha=0.0003,beta=0.003,gamma=0.03",
            "tile=16,alpha=0.0001,beta=0.001,gamma=0.01")


def parse_args():
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(qa_sets.SETS), help="comma-separated QA sets")
    ap.add_argument("--held-in", type=int, default=25, help="held-in questions per set (the sweep)")
    ap.add_argument("--limit-hotpotqa", type=int, default=100, help="questions of the hotpotqa set (held in + out)")
    ap.add_argument("--limit-2wiki", type=int, default=200, help="questions of the 2wiki set (held in + out)")
    ap.add_argument("--limit-long", type=int, default=100, help="questions of the long-document set")
    ap.add_argument("--limit-nq-long", type=int, default=100, help="questions of the NQ long-document set")
    ap.add_argument("--settings", default=";".join(SETTINGS),
                    help="semicolon-separated settings (sift-calibrate --setting syntax)")
    ap.add_argument("--guard-ca", default="",
                    help="comma-separated eps values: also sweep each setting's guarded twins (sift-calibrate "
                         "--guard-ca)")
    ap.add_argument("--guard-by", default="layer",
                    help="comma-separated: layer and / or head (sift-calibrate --guard-by)")
    ap.add_argument("--guard-prompts", type=int, default=5, help="held-in prompts the guard measures on")
    ap.add_argument("--guard-at-block", action="store_true",
                    help="the guard counts pages as the engine's kernel block computes them (sift-calibrate "
                         "--guard-at-block)")
    ap.add_argument("--held-out-all", action="store_true",
                    help="evaluate every swept setting on the held-out questions, not only the held-in front")
    ap.add_argument("--held-out-within-default", action="store_true",
                    help="evaluate on the held-out questions the paper's defaults and the setting the held-in "
                         "questions choose at no more tiles than the defaults (the defaults must be swept), and not "
                         "the rest of the held-in front")
    ap.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor (dense against dense)")
    ap.add_argument("--tag", default="", help="stored as sets[\"<set>/<dtype>/<tag>\"] (a run beside the main one)")
    ap.add_argument("--target-agreement", type=float, default=0.95)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (Triton kernels)")
    ap.add_argument("--block", type=int, default=None, choices=(16, 32, 64, 128),
                    help="kernel block (default: 128 on CUDA, the index tile on CPU; 128 on CPU computes the GPU's "
                         "blocks)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a plain transformers folder of the default model (where the GGUF package is not installed)")
    ap.add_argument("--batch", type=int, default=1, help="questions per engine call (prefilled together, decoded in "
                    "one continuous batch; a question's tile fraction is then its batch's)")
    ap.add_argument("--kv-gib", type=float, default=None, help="each engine's KV pool in GiB (default: the "
                    "engine's share of the free GPU memory; give one where several evaluations share a GPU)")
    ap.add_argument("--hotpotqa-json", type=Path, default=qa_sets.SHARED / "hotpotqa_train.json")
    ap.add_argument("--wiki", type=Path, default=qa_sets.SHARED / "wiki_vital_summaries_en.json.gz")
    ap.add_argument("--nq-json", type=Path, default=qa_sets.SHARED / "nq-open-oracle.jsonl.gz")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sift-eval-quality"),
                    help="folder for each set's calibration (indexes, reports, front.png)")
    args = ap.parse_args()
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not args.sets or not set(args.sets) <= set(qa_sets.SETS):
        ap.error(f"--sets {args.sets}: each must be one of {', '.join(qa_sets.SETS)}")
    args.settings = [s for s in args.settings.split(";") if s.strip()]
    args.guard_ca = [float(x) for x in args.guard_ca.split(",") if x.strip()]
    args.guard_by = tuple(x.strip() for x in args.guard_by.split(",") if x.strip())
    if not args.guard_by or set(args.guard_by) - set(GUARD_BY):
        ap.error(f"--guard-by {','.join(args.guard_by)!r}: choose among {', '.join(GUARD_BY)}")
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: give at least 1")
    if args.kv_gib is not None and not args.kv_gib > 0:
        ap.error(f"--kv-gib {args.kv_gib}: give a size above 0")
    if args.smoke:
        args.sets, args.held_in, args.max_new_tokens = args.sets[:1], 2, 2
        args.limit_hotpotqa = args.limit_2wiki = args.limit_long = args.limit_nq_long = 3
        args.settings = args.settings[:2]
    return args


class InProcessBuilder:
    """`calibrate_items(build=...)`: a setting and a corpus folder -> an index, profiled on one model copy."""

    def __init__(self, model_dir, device: str, dtype: str):
        from sift.model import DEFAULT_MODEL, load_model, resolve_dtype, resolve_model_dir

        name = str(model_dir) if model_dir is not None else DEFAULT_MODEL
        self.model, self.tokenizer, _ = load_model(name, dtype=resolve_dtype(dtype, device), device=device)
        self.model_dir = resolve_model_dir(name)

    def __call__(self, setting, corpus: Path, index: Path, model: str) -> None:
        from sift.pipeline.config import ProfileConfig

        cfg = ProfileConfig(**dataclasses.asdict(setting))
        qa_sets.build_in_process(qa_sets.corpus_docs(corpus), index, cfg, self.model, self.tokenizer,
                                 self.model_dir, profile_key=setting.label)


def within_default_tiles(result: dict) -> dict | None:
    """The swept setting the held-in questions choose at no more tiles than the paper's defaults compute
    (`quality.calibrate.within_tiles`), with its held-out figures and the defaults' where they were measured. None
    when the defaults were not swept."""
    points = {p["label"]: p for p in result["points"]}
    if DEFAULT.label not in points:
        return None
    ref, best = points[DEFAULT.label], within_tiles(result["points"], DEFAULT.label)
    held_out = result.get("held_out_results", {})
    out = dict(reference=DEFAULT.label, reference_held_in=dict(agreement=ref["agreement"],
                                                               tile_fraction=ref["tile_fraction"]),
               reference_held_out=held_out.get(DEFAULT.label), chosen=None)
    if best:
        out.update(chosen=best["label"], chosen_held_in=dict(agreement=best["agreement"],
                                                             tile_fraction=best["tile_fraction"]),
                   chosen_held_out=held_out.get(best["label"]))
    return out


def summary_lines(name: str, result: dict) -> list[str]:
    lines = [f"{name}: {result['held_in']} held in, {result['held_out']} held out, {result['dtype']}"]
    for p in result["points"]:
        lines.append(f"  held in  {p['label']:<32} agreement {p['agreement']:.0%}  first token "
                     f"{p['agreement_first_token']:.0%}  tiles {p['tile_fraction']:.1%}")
    for label, r in result.get("held_out_results", {}).items():
        lo, hi = r["agreement_answer_ci95"]
        lines.append(f"  held out {label:<32} agreement {r['agreement_answer']:.0%} [{lo:.0%}, {hi:.0%}]  first "
                     f"token {r['agreement_first_token']:.0%}  tiles {r['tile_fraction']:.1%}  (n={r['n']})")
    within = result.get("within_default_tiles")
    if within:
        if within["chosen"] is None:
            lines.append(f"  no swept setting computes at most the tiles of {within['reference']} on the held-in "
                         f"questions")
        else:
            out, ref = within.get("chosen_held_out"), within.get("reference_held_out")
            text = (f"held out {out['agreement_answer']:.0%} at {out['tile_fraction']:.1%} tiles" if out
                    else "not evaluated held out")
            if ref:
                text += f"; {within['reference']} held out {ref['agreement_answer']:.0%} at {ref['tile_fraction']:.1%}"
            lines.append(f"  chosen on held-in at <= {within['reference']}'s tiles: {within['chosen']}: {text}")
    for key in ("floor", "held_out_floor"):
        for dtype, f in result.get(key, {}).items():
            lines.append(f"  {key:<14} dense = transformers {dtype}: {f['agreement']:.0%} (n={f['n']})")
    return lines


def main() -> None:
    args = parse_args()
    from sift.model import DEFAULT_MODEL

    torch.manual_seed(0)
    model = str(args.model_dir) if args.model_dir is not None else DEFAULT_MODEL
    builder = InProcessBuilder(args.model_dir, args.device, args.dtype)
    settings = [parse_setting(s) for s in args.settings]
    run = dict(model=DEFAULT_MODEL, device=args.device, settings=args.settings, held_in=args.held_in,
               guard_ca=args.guard_ca, guard_by=args.guard_by, guard_prompts=args.guard_prompts,
               target_agreement=args.target_agreement, max_new_tokens=args.max_new_tokens, block=args.block,
               held_out_all=args.held_out_all, guard_at_block=args.guard_at_block, batch=args.batch,
               held_out_within_default=args.held_out_within_default,
               command=" ".join(["python", "bench/eval_quality.py", *sys.argv[1:]]))
    path = common.out_dir(args) / "eval_quality.json"
    results = json.loads(path.read_text()).get("sets", {}) if path.exists() else {}
    lines = []
    for name in args.sets:
        limit = getattr(args, "limit_" + name.replace("-", "_"))
        items = qa_sets.load_set(name, limit, hotpotqa_json=args.hotpotqa_json, wiki=args.wiki, nq_json=args.nq_json)
        print(f"{name}: {len(items)} questions", flush=True)
        t = time.perf_counter()

        def checkpoint(partial: dict) -> None:
            """What is measured so far, written as the set's entry: a run stopped by a time limit keeps it."""
            at = "/".join([name, partial["dtype"], *([args.tag] if args.tag else [])])
            partial["seconds"] = time.perf_counter() - t
            partial["within_default_tiles"] = within_default_tiles(partial)
            results[at] = dict(run=dict(run, **common.environment()), **partial)
            common.write_result("eval_quality", dict(sets=results), common.out_dir(args))

        result = calibrate_items(items, args.work / name, name=name, settings=settings, held_in=args.held_in,
                                 target=args.target_agreement, model=model, device=args.device, dtype=args.dtype,
                                 max_new_tokens=args.max_new_tokens,
                                 held_out_front=not args.held_out_within_default,
                                 held_out_all=args.held_out_all, floor=args.floor,
                                 guard_ca=args.guard_ca, guard_by=args.guard_by, guard_prompts=args.guard_prompts,
                                 guard_at_block=args.guard_at_block, block=args.block, build=builder,
                                 batch=args.batch, held_out_within=args.held_out_within_default,
                                 kv_bytes=None if args.kv_gib is None else int(args.kv_gib * 2**30),
                                 checkpoint=checkpoint, echo=lambda m: print("  " + m, flush=True))
        checkpoint(dict(result, complete=True))
        lines += summary_lines(name, result)
    print("\n".join(lines))


if __name__ == "__main__":
    common.run_main(main)
