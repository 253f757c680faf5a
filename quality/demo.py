"""`sift-serve-demo`: ask HotpotQA questions over their 10 paragraphs, with SIFT's sparse prefill and densely,
and print the answers side by side with TTFT and the fraction of attention tiles computed.

    sift-serve-demo                      3 of the first 20 questions over the sample index (index/sample,
                                         built from pipeline/sample_corpus first if it is missing, as `make
                                         demo` does)
    sift-serve-demo --all                all 100 questions; builds (or updates) an index of their 994
                                         paragraphs at --all-index first (CPU: about 10-20 minutes), then
                                         reports tile fraction and greedy agreement with dense

Exit codes: 0 success, 2 error (one line on stderr, no traceback).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from sift.errors import SiftError

from .eval import check_output_dir
from .prompts import hotpot_request, load_questions, sample_corpus

EXIT_OK, EXIT_ERROR = 0, 2


def _ensure_index(path: Path, corpus: Path | str, tile: int | None, echo) -> None:
    """Build (or incrementally update) the index at `path` from `corpus` with `sift-build`, as an operator
    would: serving code never imports the builder (and with it Ray)."""
    cmd = [str(Path(sys.executable).with_name("sift-build")), str(corpus), "--out", str(path)]
    if tile:
        cmd += ["--tile", str(tile)]
    if not Path(cmd[0]).exists():
        raise SiftError(f"{cmd[0]} not found: install the package (`make install`) to build indexes")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in (proc.stderr + proc.stdout).splitlines():
        echo(line)
    if proc.returncode == 1:
        raise SiftError(f"some documents of {corpus} could not be indexed: see `sift-inspect {path}`")
    if proc.returncode != 0:
        raise SiftError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode} (its output is above)")


def _corpus_of(questions: list[dict], folder: Path) -> Path:
    """Write the questions' paragraphs (doc_id = title) as a jsonl corpus; -> the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    for q in questions:
        for title, text in q["paragraphs"]:
            if seen.setdefault(title, text) != text:
                raise SiftError(f"paragraph title {title!r} has two different texts: it cannot be one doc_id")
    with open(folder / "hotpotqa_paragraphs.jsonl", "w") as f:
        for title, text in seen.items():
            f.write(json.dumps({"id": title, "text": text}, ensure_ascii=False) + "\n")
    return folder


def _agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def run(index_path: Path, questions: list[dict], max_new_tokens: int, batch: int, verbose: bool, echo) -> dict:
    from sift.model import DEFAULT_MODEL, load_model

    from ..runtime.engine import SiftEngine
    from ..runtime.store import SiftIndex

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _ = load_model(DEFAULT_MODEL, device=device)
    index = SiftIndex.open(index_path, device=device)
    engine = SiftEngine(model, tokenizer, index)
    echo(f"index {index_path}: generation {index.generation}, {len(index)} documents, tile {index.tile}; "
         f"backend {engine.backend}, block {engine.block}")
    rows = []
    for start in range(0, len(questions), batch):
        chunk = questions[start:start + batch]
        reqs = [hotpot_request(q) for q in chunk]
        sparse = engine.generate(reqs, max_new_tokens, mode="sift")
        dense = engine.generate(reqs, max_new_tokens, mode="dense")
        for i, q in enumerate(chunk):
            s_ids, d_ids = sparse.token_ids[i], dense.token_ids[i]
            rows.append(dict(
                id=q["id"], question=q["question"], gold=q["answer"], sift=sparse.texts[i].strip(),
                dense=dense.texts[i].strip(), tokens=sparse.prefill.n_tokens[i],
                ttft_sift=sparse.prefill.ttft_s[i], ttft_dense=dense.prefill.ttft_s[i],
                tile_fraction=sparse.prefill.tile_fraction, agree_tokens=_agreement(s_ids, d_ids),
                identical=s_ids == d_ids, first_equal=s_ids[:1] == d_ids[:1]))
            if verbose:
                r = rows[-1]
                echo(f"\nQ{start + i + 1}: {r['question']}  (gold: {r['gold']})\n"
                     f"  sift : {_shorten(r['sift'], 90)}\n  dense: {_shorten(r['dense'], 90)}\n"
                     f"  {r['tokens']} prompt tokens, TTFT sift {r['ttft_sift']:.2f}s / dense {r['ttft_dense']:.2f}s, "
                     f"tiles computed {r['tile_fraction']:.1%}, greedy agreement {r['agree_tokens']} tokens")
    n = len(rows)
    contains = lambda key: sum(r["gold"].lower() in r[key].lower() for r in rows) / n  # noqa: E731
    summary = dict(
        questions=n, backend=engine.backend, block=engine.block, tile=index.tile,
        mean_tile_fraction=statistics.fmean(r["tile_fraction"] for r in rows),
        first_token_agreement=sum(r["first_equal"] for r in rows) / n,
        identical_generations=sum(r["identical"] for r in rows) / n,
        mean_agree_tokens=statistics.fmean(r["agree_tokens"] for r in rows),
        gold_in_answer_sift=contains("sift"), gold_in_answer_dense=contains("dense"),
        mean_ttft_sift=statistics.fmean(r["ttft_sift"] for r in rows),
        mean_ttft_dense=statistics.fmean(r["ttft_dense"] for r in rows),
    )
    return dict(summary=summary, rows=rows)


def _table(rows: list[dict], echo) -> None:
    echo("")
    echo(f"{'#':>3} {'gold':<18} {'sift answer':<30} {'dense answer':<30} {'TTFT sift':>9} {'dense':>7} {'tiles':>6}")
    for i, r in enumerate(rows, 1):
        echo(f"{i:>3} {_shorten(r['gold'], 18):<18} {_shorten(r['sift'], 30):<30} {_shorten(r['dense'], 30):<30} "
             f"{r['ttft_sift']:>8.2f}s {r['ttft_dense']:>6.2f}s {r['tile_fraction']:>6.1%}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--index", "index_path", type=click.Path(path_type=Path), default=Path("index/sample"),
              show_default=True, help="Index of the first 20 questions' paragraphs (built from the sample "
                                      "corpus if missing).")
@click.option("--questions", type=click.IntRange(1, 20), default=3, show_default=True,
              help="How many of the first 20 HotpotQA questions to ask.")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=24, show_default=True)
@click.option("--batch", type=click.IntRange(1, 64), default=1, show_default=True, help="Requests per batch.")
@click.option("--all", "all_questions", is_flag=True,
              help="All 100 questions over an index of all their paragraphs (built at --all-index if missing).")
@click.option("--all-index", type=click.Path(path_type=Path), default=Path("index/hotpotqa100"), show_default=True)
@click.option("--tile", type=click.Choice(["16", "32", "64", "128"]), default=None,
              help="Tile of an index that --all builds (default: configs/default.toml).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="Write the results as JSON.")
def main(index_path, questions, max_new_tokens, batch, all_questions, all_index, tile, json_out):
    """Answer HotpotQA questions with SIFT (sparse) and dense prefill, side by side."""
    echo = lambda msg: click.echo(msg, err=False)  # noqa: E731
    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    try:
        if json_out is not None:  # checked before any work, so that the results have somewhere to go
            if json_out.is_dir():
                raise SiftError(f"--json-out {json_out} is a folder: give the path of a file")
            check_output_dir(json_out.parent, "--json-out")
        if all_questions:
            qs = load_questions()
            if not (all_index / "manifest.json").exists():
                with tempfile.TemporaryDirectory() as tmp:
                    _ensure_index(all_index, _corpus_of(qs, Path(tmp) / "corpus"), int(tile) if tile else None,
                                  log)
            result = run(all_index, qs, max_new_tokens, batch, verbose=False, echo=log)
        else:
            if not (index_path / "manifest.json").exists():
                corpus = sample_corpus()
                log(f"{index_path} has no index yet: building it from {corpus} (as `make demo` does)")
                _ensure_index(index_path, corpus, None, log)
            result = run(index_path, load_questions(20)[:questions], max_new_tokens, batch, verbose=True, echo=echo)
    except SiftError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_ERROR)
    if not all_questions:
        _table(result["rows"], echo)
    s = result["summary"]
    echo(f"\n{s['questions']} questions, backend {s['backend']} (block {s['block']}, index tile {s['tile']}): "
         f"tiles computed {s['mean_tile_fraction']:.1%} of dense; greedy agreement with dense: first token "
         f"{s['first_token_agreement']:.0%}, whole answer {s['identical_generations']:.0%} "
         f"(mean {s['mean_agree_tokens']:.1f} tokens); gold answer contained: sift {s['gold_in_answer_sift']:.0%}, "
         f"dense {s['gold_in_answer_dense']:.0%}; mean TTFT sift {s['mean_ttft_sift']:.2f}s, "
         f"dense {s['mean_ttft_dense']:.2f}s")
    if s["backend"] != "triton":
        echo("(CPU backend: the sparse pattern is applied as a mask over dense attention, so TTFT shows no "
             "speedup here; the Triton kernels skip the masked tiles on a GPU, see bench/bench_ttft.py)")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
