"""`sift-eval`: what skipping tiles costs in answers. An index and a QA set in; for every mode, greedy answers
compared with dense and with the gold answers, aggregated with bootstrap confidence intervals; a report out.

    sift-eval INDEX QA_FILE --modes dense,sift [--model M] [--limit N] [--batch B] [--max-new-tokens T]
              [--dtype auto|float32|bfloat16|float16] [--block B] [--recall [--recall-limit N] [--recall-at-block]]
              [--kv-store-gib G] --out DIR

INDEX is a folder or an object-store URI. Modes: dense, sift, and the KV-reuse modes reuse, hybrid,
hybrid:<policy>, hybrid:<policy>@<fraction> (runtime/reuse.py; they run with a KVStore of --kv-store-gib), and
the reference oracle@<coverage> (quality/oracle.py): sift with the bits of the index's format chosen from each
prompt's own exact attention, keeping at least <coverage> of every (layer, head)'s document-row attention mass
in the fewest blocks (at the engine's block; its TTFT leaves out the exact pass that chooses them), and
reader@<coverage>, a candidate offline criterion measured the same way: each document's bits chosen from its own
attention and that of a fixed reader text placed after it, so the same for the document in every request.

writes
    DIR/report.json   settings; `modes.<mode>`: `n` and, for each metric below, {"mean": x, "ci95": [lo, hi]}
                      (percentile bootstrap of the mean over questions; null when no question ran); `rows`: one
                      per question with each mode's answer and metrics; `skipped`: {"id", "question", "reason"}
                      for questions not run (a document missing from the index or stale, a prompt too long)
                      With --recall, `recall`: the SIFT paper's in-context recall of the index's bits on the
                      evaluated prompts (quality/recall.py): LA / CA recall, LA / CA sparsity and the attention
                      mass the sparse pattern keeps, per layer and in total, beside the paper's figures; at the
                      index tile, or with --recall-at-block as the engine's kernel block computes the bits
    DIR/report.md     the summary table (and the recall table)
    DIR/summary.png   the per-mode means with their intervals
    DIR/recall.png    with --recall: recall and sparsity per layer

Metrics per question and mode (dense is always run: it is the reference):
    agreement_first_token   1 if the first greedy token equals dense's
    agreement_answer        1 if the whole greedy answer (token ids, up to eos or --max-new-tokens) equals dense's
    em, f1                  SQuAD: answers normalised (lower case, no punctuation, no articles a / an / the,
                            single spaces), F1 over token bags; the best over the gold answers
    containment             1 if a normalised gold answer occurs, whole words, in the normalised answer
    kl_first_token          KL(dense || mode) of the first-token distributions, in nats
    tile_fraction           (head, query block, key block) triples computed over the dense causal count, all
                            layers, of the question's batch (1.0 in dense mode)
    ttft_s                  prefill seconds of the question's batch (each mode is warmed up once first)

With --batch 1 (the default) tile_fraction and ttft_s are the question's own.
Exit codes: 0 the eval ran (skipped questions included), 2 bad usage or input (one line on stderr).
"""
from __future__ import annotations

import json
import os
import re
import string
import sys
from collections import Counter
from pathlib import Path

import click
import numpy as np
import torch

from sift.errors import SiftError
from sift.format import TILES, content_hash
from sift.model import DTYPES, resolve_dtype
from sift.plots import mode_summary, recall_by_layer

from ..runtime.engine import GenerateResult, SiftEngine
from ..runtime.modes import KINDS as MODES
from ..runtime.modes import Mode
from ..runtime.reuse import POLICIES
from ..runtime.supplied_bits import generate_with_bits, prefill_with_bits
from . import oracle
from .qa import FORMATS, QAItem, load_qa
from .recall import measure as measure_recall

EXIT_OK, EXIT_ERROR = 0, 2
REFERENCE = "dense"
METRICS = ("agreement_first_token", "agreement_answer", "em", "f1", "containment", "kl_first_token",
           "tile_fraction", "ttft_s")
CI_LEVEL = 0.95

# ---------------------------------------------------------------------------------------------- metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, punctuation removed, articles a / an / the removed, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def _f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds) -> float:
    """SQuAD token F1 (bags of normalised tokens), the best over the gold answers."""
    return max(_f1(prediction, g) for g in golds)


def containment(prediction: str, golds) -> float:
    """1.0 if a normalised gold answer occurs in the normalised prediction as whole words."""
    p = f" {normalize_answer(prediction)} "
    return float(any(normalize_answer(g) and f" {normalize_answer(g)} " in p for g in golds))


def kl_first_token(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) in nats of the distributions the logits [vocab] define (fp64)."""
    p, q = torch.log_softmax(reference_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def bootstrap_ci(values, *, resamples: int = 2000, level: float = CI_LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (non-empty): resample with replacement."""
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def summarise(values, *, resamples: int = 2000, seed: int = 0) -> dict:
    """-> {"mean": x, "ci95": [lo, hi]}; both None without values."""
    if not values:
        return {"mean": None, "ci95": None}
    return {"mean": float(np.mean(values)), "ci95": list(bootstrap_ci(values, resamples=resamples, seed=seed))}


# ------------------------------------------------------------------------------------------------- running


def skip_reason(engine: SiftEngine, item: QAItem) -> str | None:
    """Why a question cannot be evaluated against the engine's index (None: it can)."""
    request = item.request()
    try:
        segments = engine.tokenize(request)
    except SiftError as e:
        return str(e)
    index = engine.index
    doc_tokens = [ids for kind, ids in segments if kind == "doc"]
    for (doc_id, _), ids in zip(request.docs, doc_tokens):
        if doc_id not in index:
            return f"document {doc_id!r} is not in the index: add it to the corpus and rebuild with `sift-build`"
        entry = index.entry(doc_id)
        if content_hash(ids) != entry.content_hash:
            return (f"document {doc_id!r} is stale: it tokenises to {len(ids)} tokens here, {entry.n_tokens} in the "
                    f"index, with another content_hash; rebuild the index with `sift-build`")
    return None


def _generate(engine: SiftEngine, items: list[QAItem], modes, max_new_tokens: int | None) -> dict[str, GenerateResult]:
    """Every mode on one batch (max_new_tokens None: prefill only, -> PrefillResults). The oracle modes share
    one exact pass per prompt."""
    requests = [item.request() for item in items]
    parsed = {m: oracle.parse_mode(m) for m in modes}
    masses = (oracle.batch_masses(engine, requests) if any(p and p[0] == "oracle" for p in parsed.values())
              else None)
    readers = oracle.ReaderCache()
    out = {}
    for mode in modes:
        if parsed[mode] is None:
            out[mode] = (engine.generate(requests, max_new_tokens, mode=mode) if max_new_tokens
                         else engine.prefill(requests, mode=mode))
            continue
        name, coverage = parsed[mode]
        bits = (oracle.batch_bits(engine, requests, coverage, masses) if name == "oracle"
                else oracle.reader_bits(engine, requests, coverage, readers))
        out[mode] = (generate_with_bits(engine, requests, max_new_tokens, bits) if max_new_tokens
                     else prefill_with_bits(engine, requests, bits))
    return out


def _score(item: QAItem, results: dict[str, GenerateResult], i: int) -> dict:
    """One question's row: each mode's answer and metrics (i: its position in the batch)."""
    ref = results[REFERENCE]
    ref_ids, ref_logits = ref.token_ids[i], ref.prefill.logits[i]
    modes = {}
    for mode, r in results.items():
        ids, answer = r.token_ids[i], r.texts[i].strip()
        modes[mode] = dict(
            answer=answer, agreement_first_token=float(ids[:1] == ref_ids[:1]),
            agreement_answer=float(ids == ref_ids), em=exact_match(answer, item.answers),
            f1=f1_score(answer, item.answers), containment=containment(answer, item.answers),
            kl_first_token=kl_first_token(ref_logits, r.prefill.logits[i]),
            tile_fraction=r.prefill.tile_fraction, ttft_s=r.prefill.ttft_s[i])
    return dict(id=item.id, question=item.question, answers=list(item.answers),
                n_tokens=ref.prefill.n_tokens[i], modes=modes)


def _skipped(item: QAItem, reason: str) -> dict:
    return dict(id=item.id, question=item.question, reason=reason)


def _run_batch(engine, chunk: list[QAItem], modes, max_new_tokens: int) -> tuple[list[dict], list[dict]]:
    """-> (rows, skipped). A batch the engine refuses is rerun one question at a time, so that only the
    questions it refuses are skipped (with the engine's message)."""
    try:
        results = _generate(engine, chunk, modes, max_new_tokens)
    except SiftError as e:
        if len(chunk) == 1:
            return [], [_skipped(chunk[0], str(e))]
        rows, skipped = [], []
        for item in chunk:
            r, s = _run_batch(engine, [item], modes, max_new_tokens)
            rows += r
            skipped += s
        return rows, skipped
    return [_score(item, results, i) for i, item in enumerate(chunk)], []


def evaluate(engine: SiftEngine, items: list[QAItem], modes, *, batch: int = 1, max_new_tokens: int = 24,
             echo=lambda msg: None, warmup: bool = True) -> tuple[list[dict], list[dict]]:
    """Run every mode on every question the index can serve -> (rows, skipped), in the QA set's order.
    warmup: run each mode once on the first question before the timed runs (False: TTFT includes one-off costs;
    for answer-only measurements)."""
    modes = [REFERENCE, *(m for m in modes if m != REFERENCE)]
    runnable, skipped = [], []
    for item in items:
        reason = skip_reason(engine, item)
        if reason:
            skipped.append(_skipped(item, reason))
        else:
            runnable.append(item)
    if runnable and warmup:  # first calls pay one-off costs (allocator, kernel compilation): keep them out of TTFT
        for mode in modes:
            try:
                _generate(engine, runnable[:1], [mode], None)
            except SiftError:
                pass  # the question is refused again, and reported, below
    rows = []
    for start in range(0, len(runnable), batch):
        r, s = _run_batch(engine, runnable[start:start + batch], modes, max_new_tokens)
        rows += r
        skipped += s
        echo(f"{min(start + batch, len(runnable))}/{len(runnable)} questions")
    order = {item.id: k for k, item in enumerate(items)}
    return rows, sorted(skipped, key=lambda s: order.get(s["id"], 0))


def aggregate(rows: list[dict], modes, *, resamples: int = 2000, seed: int = 0) -> dict:
    """-> {mode: {"n": questions, metric: {"mean", "ci95"}}}."""
    out = {}
    for mode in modes:
        out[mode] = {"n": len(rows)}
        for metric in METRICS:
            out[mode][metric] = summarise([r["modes"][mode][metric] for r in rows], resamples=resamples, seed=seed)
    return out


# -------------------------------------------------------------------------------------------------- report

_COLUMNS = (("tile_fraction", "tiles computed", "{:.1%}"), ("agreement_first_token", "first token = dense", "{:.0%}"),
            ("agreement_answer", "answer = dense", "{:.0%}"), ("em", "EM", "{:.0%}"), ("f1", "F1", "{:.2f}"),
            ("containment", "gold contained", "{:.0%}"), ("kl_first_token", "KL first token", "{:.3g}"),
            ("ttft_s", "TTFT s", "{:.3f}"))


def cell(stat: dict, fmt: str) -> str:
    """A metric's `mean [lo, hi]` for a table, '-' when no question ran."""
    if stat["mean"] is None:
        return "-"
    lo, hi = stat["ci95"]
    return f"{fmt.format(stat['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def markdown(report: dict) -> str:
    """The summary table (mean [95% bootstrap interval]) and the skipped questions."""
    s = report["settings"]
    lines = [f"# sift-eval: {Path(s['qa_file']).name}", "",
             f"{report['evaluated']} of {report['questions']} questions ({s['format']} format), index {s['index']} "
             f"(tile {s['tile']}), model {s['model']}, backend {s['backend']} (block {s['block']}), greedy, "
             f"{s['max_new_tokens']} new tokens at most, batch {s['batch']}. Each cell: mean [95% bootstrap "
             f"interval]; agreement is with dense.", "",
             "| mode | n | " + " | ".join(title for _, title, _ in _COLUMNS) + " |",
             "|---|---:|" + "---:|" * len(_COLUMNS)]
    for mode, stats in report["modes"].items():
        cells = [cell(stats[key], fmt) for key, _, fmt in _COLUMNS]
        lines.append(f"| {mode} | {stats['n']} | " + " | ".join(cells) + " |")
    if report.get("recall"):
        lines += ["", *recall_markdown(report["recall"])]
    if report["skipped"]:
        lines += ["", f"Skipped ({len(report['skipped'])}):", ""]
        lines += [f"- `{s['id']}`: {s['reason']}" for s in report["skipped"]]
    return "\n".join(lines) + "\n"


_RECALL_COLUMNS = (("la_recall", "LA recall"), ("la_sparsity", "LA sparsity"), ("ca_recall", "CA recall"),
                   ("ca_sparsity", "CA sparsity"), ("mass_kept", "attention mass kept"),
                   ("ca_mass_lost", "mass on dropped CA pages"))


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def recall_markdown(recall: dict) -> list[str]:
    """The recall section: the total beside the paper's figures, then one row per layer."""
    at = f", counted at kernel block {recall['block']}" if recall.get("block", recall["tile"]) != recall["tile"] else ""
    lines = [f"## In-context recall of the bits ({recall['prompts']} prompts, alpha {recall['alpha']:g}, "
             f"beta {recall['beta']:g}, tile {recall['tile']}{at})", "",
             "| | " + " | ".join(title for _, title in _RECALL_COLUMNS) + " |",
             "|---|" + "---:|" * len(_RECALL_COLUMNS),
             "| this index | " + " | ".join(_pct(recall["total"][k]) for k, _ in _RECALL_COLUMNS) + " |",
             "| SIFT paper (Llama-3-8B, LongBench) | " + " | ".join(_pct(recall["paper"].get(k))
                                                                    for k, _ in _RECALL_COLUMNS) + " |",
             "", "| layer | " + " | ".join(title for _, title in _RECALL_COLUMNS) + " |",
             "|---:|" + "---:|" * len(_RECALL_COLUMNS)]
    for row in recall["layers"]:
        lines.append(f"| {row['layer']} | " + " | ".join(_pct(row[k]) for k, _ in _RECALL_COLUMNS) + " |")
    return lines


def plot(report: dict, path: Path) -> None:
    """Per-mode means with their 95% intervals: the rates on the left, TTFT on the right."""
    labels = {key: title for key, title, _ in _COLUMNS}
    rates = [(key, labels[key]) for key, _, _ in _COLUMNS if key not in ("kl_first_token", "ttft_s")]
    mode_summary(path, report["modes"], rates, [("ttft_s", labels["ttft_s"])],
                 f"{report['evaluated']} questions, mean and 95% bootstrap interval")


def check_output_dir(path: Path, option: str = "--out") -> None:
    """Before any work, so that results are never lost at the end: `path` must be a folder, or one that can be
    made (its nearest existing ancestor is a folder this process can write). Nothing is created here: a run that
    fails on other input leaves no folder behind."""
    if path.exists() and not path.is_dir():
        raise SiftError(f"{option} {path} is a file, not a folder: give a folder for the results (created if missing)")
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SiftError(f"{option} {path} cannot be created: {ancestor} is a file, not a folder; give another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SiftError(f"{option} {path} cannot be written: {ancestor} is not writable; give a folder you can write")


def write_report(report: dict, out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        (out / "report.md").write_text(markdown(report))
        plot(report, out / "summary.png")
        if report.get("recall"):
            recall_by_layer(out / "recall.png", report["recall"])
    except OSError as e:  # the folder was checked at the start; it changed since (removed, full, read-only)
        raise SiftError(f"cannot write the report into {out} ({e.strerror or e}): give a folder you can "
                        f"write") from None


# ------------------------------------------------------------------------------------------------------ CLI


def _parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    for m in modes:
        oracle.parse_mode(m)  # a malformed oracle@C / reader@C says so itself
    bad = [m for m in modes if oracle.parse_mode(m) is None and not _engine_mode_ok(m)]
    if not modes or bad:
        raise SiftError(f"--modes {text!r}: each mode must be one of {', '.join(MODES)}, "
                        f"hybrid:<policy>[@<fraction>] with a policy in {', '.join(POLICIES)}, "
                        f"ape@<temperature>:<scale>, oracle@<coverage> or reader@<coverage> (comma-separated)")
    return [REFERENCE, *(m for m in modes if m != REFERENCE)]


def _engine_mode_ok(mode: str) -> bool:
    try:
        Mode.parse(mode)
    except SiftError:
        return False
    return True


def _engine(index_path: str, model: str | None, device: str, backend: str,
            kv_store_gib: float = 0.0, dtype: str = "auto", block: int | None = None) -> SiftEngine:
    """The engine over the index at `index_path` (a folder or an object-store URI); with a KV store of
    kv_store_gib (modes reuse / hybrid); block: the kernel block (None: the engine's default)."""
    from sift.model import load_model

    from ..runtime.kv_store import KVStore
    from ..runtime.store import SiftIndex

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    index = SiftIndex.open(index_path, device=device)
    hf, tokenizer, _ = load_model(model or index.model_name, dtype=resolve_dtype(dtype, device), device=device)
    store = KVStore(hbm_bytes=int(kv_store_gib * 2**30)) if kv_store_gib > 0 else None
    return SiftEngine(hf, tokenizer, index, backend=backend, kv_store=store, block=block)


def run(index_path: Path, qa_file: Path, *, modes: list[str], model: str | None = None, fmt: str = "auto",
        limit: int | None = None, batch: int = 1, max_new_tokens: int = 24, device: str = "auto",
        backend: str = "auto", resamples: int = 2000, seed: int = 0, recall: bool = False,
        recall_limit: int | None = None, kv_store_gib: float = 4.0, dtype: str = "auto", block: int | None = None,
        recall_at_block: bool = False, items: list[QAItem] | None = None, echo=lambda msg: None) -> dict:
    """The whole eval -> the report (as report.json holds it). recall: also measure the bits' in-context recall
    on the first `recall_limit` (None: all) evaluated questions, at the index tile (recall_at_block: as the
    engine's kernel block computes the bits). kv_store_gib: the KV store of the reuse modes (created only when
    one is asked for). block: the engine's kernel block (None: 128 on CUDA, the index tile on CPU). items: the
    questions already read (qa_file then only names them in the report)."""
    if items is None:
        items, fmt = load_qa(qa_file, fmt, limit)
    else:
        items, fmt = items[:limit], "given"
    reusing = any(oracle.parse_mode(m) is None and Mode.parse(m).reuses for m in modes)
    engine = _engine(index_path, model, device, backend, kv_store_gib if reusing else 0.0, dtype, block)
    echo(f"{len(items)} questions ({fmt}); index {index_path}: {len(engine.index)} documents, tile "
         f"{engine.index.tile}; backend {engine.backend}, block {engine.block}; modes {', '.join(modes)}")
    rows, skipped = evaluate(engine, items, modes, batch=batch, max_new_tokens=max_new_tokens, echo=echo)
    settings = dict(index=str(engine.index.path), qa_file=str(qa_file), format=fmt, model=model or engine.index.model_name,
                    dtype=str(engine.model.dtype).removeprefix("torch."), backend=engine.backend, block=engine.block,
                    tile=engine.index.tile, modes=modes,
                    max_new_tokens=max_new_tokens, batch=batch, limit=limit,
                    ci=dict(method="percentile bootstrap of the mean", level=CI_LEVEL, resamples=resamples,
                            seed=seed))
    report = dict(settings=settings, questions=len(items), evaluated=len(rows),
                  modes=aggregate(rows, modes, resamples=resamples, seed=seed), rows=rows, skipped=skipped)
    if recall:
        evaluated = {r["id"] for r in rows}
        requests = [item.request() for item in items if item.id in evaluated][:recall_limit]
        report["recall"] = measure_recall(engine, requests, echo=echo,
                                          block=engine.block if recall_at_block else None)
    return report


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("index_path", metavar="INDEX")
@click.argument("qa_file", type=click.Path(path_type=Path))
@click.option("--modes", default="dense,sift", show_default=True,
              help=f"Comma-separated modes to compare ({', '.join(MODES)}, oracle@<coverage>, reader@<coverage>); dense is always "
                   f"run, as the reference.")
@click.option("--model", default=None, help="The served model (default: the index's model).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="QA set format (auto: from the first row's fields).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Evaluate the first N questions only.")
@click.option("--batch", type=click.IntRange(1, 64), default=1, show_default=True, help="Questions per engine call.")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=24, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="The dtype the model serves in (auto: bfloat16 on CUDA, float32 on CPU).")
@click.option("--backend", type=click.Choice(["auto", "triton", "torch", "reference"]), default="auto",
              show_default=True)
@click.option("--resamples", type=click.IntRange(100), default=2000, show_default=True,
              help="Bootstrap resamples of each interval.")
@click.option("--recall", is_flag=True,
              help="Also measure the bits' in-context LA / CA recall and sparsity (the SIFT paper's way).")
@click.option("--recall-limit", type=click.IntRange(1), default=None,
              help="Measure recall on the first N evaluated questions only (default: all).")
@click.option("--recall-at-block", is_flag=True,
              help="Count recall and sparsity as the engine's kernel block computes the bits (a tile or page the "
                   "bits drop inside a computed block counts as kept) instead of at the index tile.")
@click.option("--block", type=click.Choice([str(t) for t in TILES]), default=None,
              callback=lambda _c, _p, v: None if v is None else int(v),
              help="The kernel block (default: 128 on CUDA, the index tile on CPU); --block 128 on CPU computes "
                   "the blocks a GPU computes.")
@click.option("--kv-store-gib", type=click.FloatRange(0.01), default=4.0, show_default=True,
              help="HBM (host memory on CPU) of the KV store the reuse / hybrid modes use.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Folder for report.json, report.md and summary.png.")
def main(index_path, qa_file, modes, model, fmt, limit, batch, max_new_tokens, device, dtype, backend, resamples,
         recall, recall_limit, recall_at_block, block, kv_store_gib, out):
    """Evaluate the answers of each mode against dense and the gold answers of a QA set over INDEX.

    QA_FILE: JSONL of {"id", "question", "answers": [...], "docs": [{"id", "text"}], "prefix"?}, or the
    HotpotQA, MuSiQue or 2WikiMultihopQA format (.json / .jsonl, optionally .gz). Exit codes: 0 ran, 2 bad
    usage or input."""
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    try:
        modes = _parse_modes(modes)
        check_output_dir(out)
        report = run(index_path, qa_file, modes=modes, model=model, fmt=fmt, limit=limit, batch=batch,
                     max_new_tokens=max_new_tokens, device=device, backend=backend, resamples=resamples,
                     recall=recall, recall_limit=recall_limit, kv_store_gib=kv_store_gib, dtype=dtype, block=block,
                     recall_at_block=recall_at_block, echo=log)
        write_report(report, out)
    except SiftError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(markdown(report), nl=False)
    sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
