"""sift-eval (quality/eval.py, quality/qa.py): the metrics against hand-computed values, the bootstrap interval on
known cases, the QA readers on tiny hand-written files of each format, and the CLI end to end on CPU with the real
SmolLM2 over an all-ones index (where SIFT must equal dense), a missing and a stale document reported as skipped.
"""
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from sift.errors import SiftError
from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
from sift.quality.prompts import HOTPOTQA, QUERY, SYSTEM
from sift.runtime import GenerateResult, PrefillResult
from sift.quality.eval import (bootstrap_ci, containment, evaluate, exact_match, f1_score, kl_first_token, main,
                              normalize_answer)
from sift.quality.qa import QAItem, load_qa, sniff_format, write_corpus

from .helpers import rounding_tol, smollm2
from .test_engine import write_index

SIFT_EVAL = Path(sys.executable).with_name("sift-eval")

# ----------------------------------------------------------------------------------------------- metrics


def test_normalize_answer():
    assert normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match_and_f1_hand_computed():
    assert exact_match("The Paris.", ["paris"]) == 1.0
    assert exact_match("Paris France", ["Paris"]) == 0.0
    assert exact_match("Lyon", ["Paris", "lyon"]) == 1.0  # any gold counts
    # prediction {paris, france}, gold {paris}: precision 1/2, recall 1 -> 2/3
    assert f1_score("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    # bags: prediction {new x2, york}, gold {new, york}: 2 shared, precision 2/3, recall 1 -> 0.8
    assert f1_score("new york new", ["New York"]) == pytest.approx(0.8)
    assert f1_score("a spirit", ["demon", "the spirit"]) == 1.0  # best over golds
    assert f1_score("Berlin", ["Paris"]) == 0.0


def test_containment():
    assert containment("It is Paris, France.", ["paris"]) == 1.0
    assert containment("Parisian food", ["Paris"]) == 0.0  # whole words only
    assert containment("the United States of America", ["united states", "usa"]) == 1.0


def test_kl_first_token():
    assert kl_first_token(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])) == 0.0
    # p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    got = kl_first_token(torch.tensor([0.0, 0.0]), torch.tensor([math.log(3.0), 0.0], dtype=torch.float64))
    assert got == pytest.approx(0.5 * math.log(4 / 3), rel=1e-9)


def test_bootstrap_ci_known_cases():
    lo, hi = bootstrap_ci([0.7] * 20)
    assert lo == hi == pytest.approx(0.7)
    # 50 zeros and 50 ones: the mean's standard error is sqrt(0.25 / 100) = 0.05, so about 0.5 +- 0.098
    lo, hi = bootstrap_ci([0.0] * 50 + [1.0] * 50, resamples=4000)
    assert 0.38 < lo < 0.44 and 0.56 < hi < 0.62
    # Two values: the resampled mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4, so its 2.5% and 97.5%
    # quantiles are the two values themselves.
    assert bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    # 30 ones in 100: the resampled sum is Binomial(100, 0.3); the interval is its 2.5% and 97.5% quantiles / 100,
    # computed from the binomial distribution (up to the resampling noise of 4000 draws).
    cdf, quantiles = 0.0, {}
    for k in range(101):
        cdf += math.comb(100, k) * 0.3**k * 0.7 ** (100 - k)
        for q in (0.025, 0.975):
            if cdf >= q and q not in quantiles:
                quantiles[q] = k / 100
    lo, hi = bootstrap_ci([1.0] * 30 + [0.0] * 70, resamples=4000)
    assert lo == pytest.approx(quantiles[0.025], abs=0.015) and hi == pytest.approx(quantiles[0.975], abs=0.015)


# ----------------------------------------------------------------------------------------------- readers


def _write(path: Path, rows, *, array: bool = False) -> Path:
    text = json.dumps(rows) if array else "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text)
    return path


def test_reader_jsonl(tmp_path):
    f = _write(tmp_path / "qa.jsonl", [
        {"id": "q1", "question": "Who?", "answers": ["Ann", "Anne"], "docs": [{"id": "d1", "text": "Ann wrote it."}]},
        {"id": "q2", "question": "What?", "answers": ["x"], "docs": [], "prefix": "Read:\n"}])
    items, fmt = load_qa(f)
    assert fmt == "jsonl"
    assert [i.id for i in items] == ["q1", "q2"]
    assert items[0].answers == ("Ann", "Anne") and items[0].docs == (("d1", "Ann wrote it."),)
    req = items[0].request()
    assert req.prefix == SYSTEM and req.query == QUERY.format(question="Who?")
    assert list(req.docs) == [("d1", "Ann wrote it.")]
    assert items[1].request().prefix == "Read:\n"
    assert len(load_qa(f, limit=1)[0]) == 1


def test_reader_hotpotqa_official_json(tmp_path):
    f = _write(tmp_path / "hotpot_dev.json", [
        {"_id": "h1", "question": "Which is older?", "answer": "Oak",
         "context": [["Oak", ["Oak is a tree.", " It is old."]], ["Elm", ["Elm is a tree."]]],
         "supporting_facts": [["Oak", 0]], "type": "comparison", "level": "easy"}], array=True)
    items, fmt = load_qa(f)
    assert fmt == "hotpotqa"
    assert items[0].id == "h1" and items[0].answers == ("Oak",)
    assert items[0].docs == (("Oak", "Oak is a tree. It is old."), ("Elm", "Elm is a tree."))


def test_reader_hotpotqa_shipped_data():
    items, fmt = load_qa(HOTPOTQA, limit=2)
    assert fmt == "hotpotqa" and len(items) == 2
    assert items[0].question == "If Gallu is a demon Lilu is what?" and items[0].answers == ("a spirit",)
    assert len(items[0].docs) == 10 and items[0].docs[0][0] == "Demon Dice"


def test_reader_musique(tmp_path):
    f = _write(tmp_path / "musique.jsonl", [
        {"id": "2hop_1", "question": "Where was X born?", "answer": "Rome", "answer_aliases": ["Roma"],
         "answerable": True, "question_decomposition": [],
         "paragraphs": [{"idx": 0, "title": "X", "paragraph_text": "X was born in Rome.", "is_supporting": True},
                        {"idx": 1, "title": "X", "paragraph_text": "X died in Paris.", "is_supporting": False},
                        {"idx": 2, "title": "Y", "paragraph_text": "Y is a town.", "is_supporting": False}]}])
    items, fmt = load_qa(f)
    assert fmt == "musique"
    assert items[0].answers == ("Rome", "Roma")
    assert items[0].docs == (("X", "X was born in Rome."), ("X#2", "X died in Paris."), ("Y", "Y is a town."))


def test_reader_2wiki(tmp_path):
    f = _write(tmp_path / "2wiki_dev.json", [
        {"_id": "w1", "type": "compositional", "question": "Who is the father of Z?", "answer": "Q",
         "context": [["Z", ["Z is a prince.", "His father is Q."]]], "supporting_facts": [["Z", 1]],
         "evidences": [["Z", "father", "Q"]]}], array=True)
    items, fmt = load_qa(f)
    assert fmt == "2wiki"
    assert items[0].docs == (("Z", "Z is a prince. His father is Q."),)


def test_reader_gz_and_forced_format(tmp_path):
    rows = [{"id": "q", "question": "?", "answers": ["a"], "docs": [{"id": "d", "text": "t"}]}]
    f = tmp_path / "qa.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps(rows[0]) + "\n")
    assert load_qa(f, "jsonl")[0][0].docs == (("d", "t"),)
    with pytest.raises(SiftError, match="musique"):
        load_qa(f, "musique")


def test_reader_errors(tmp_path):
    with pytest.raises(SiftError, match="does not exist"):
        load_qa(tmp_path / "nope.jsonl")
    with pytest.raises(SiftError, match="cannot tell the QA format"):
        sniff_format({"question": "?", "answer": "a"})
    f = _write(tmp_path / "bad.jsonl", [{"id": "q", "question": "?", "answers": [], "docs": []}])
    with pytest.raises(SiftError, match="row 1 .*non-empty list"):
        load_qa(f)


def test_write_corpus(tmp_path):
    f = _write(tmp_path / "qa.jsonl", [
        {"id": "1", "question": "?", "answers": ["a"], "docs": [{"id": "d", "text": "one"}, {"id": "e", "text": "e"}]},
        {"id": "2", "question": "?", "answers": ["a"], "docs": [{"id": "d", "text": "two"}]}])
    conflicts = write_corpus(load_qa(f)[0], tmp_path / "corpus" / "docs.jsonl")
    assert conflicts == ["d"]
    lines = [json.loads(x) for x in (tmp_path / "corpus" / "docs.jsonl").read_text().splitlines()]
    assert lines == [{"id": "d", "text": "one"}, {"id": "e", "text": "e"}]


# ------------------------------------------------------------------------------------------ end to end (CLI)

DOCS = {
    "france": "France is a country in Europe. Its capital and largest city is Paris, on the Seine.",
    "japan": "Japan is an island country in East Asia. Its capital is Tokyo, the largest city of the country.",
    "kenya": "Kenya is a country in East Africa. Its capital and largest city is Nairobi.",
}
QUESTIONS = [
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"], "docs": ["france", "japan"]},
    {"id": "q2", "question": "What is the capital of Japan?", "answers": ["Tokyo"], "docs": ["kenya", "japan"]},
    {"id": "q3", "question": "What is the capital of Kenya?", "answers": ["Nairobi"], "docs": ["kenya"]},
]


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(SIFT_EVAL), *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    """An all-ones tile-16 index of three short documents, and a QA set of the three questions over them plus
    one question citing a document the index lacks and one whose document's text changed since indexing."""
    model, tokenizer = smollm2()
    root = tmp_path_factory.mktemp("eval")
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for d, t in DOCS.items()}
    write_index(root / "index", model, fingerprint(resolve_model_dir(DEFAULT_MODEL)), ids, tile=16)
    rows = [dict(q, docs=[{"id": d, "text": DOCS[d]} for d in q["docs"]]) for q in QUESTIONS]
    rows.append({"id": "missing", "question": "?", "answers": ["x"], "docs": [{"id": "peru", "text": "Peru."}]})
    rows.append({"id": "stale", "question": "?", "answers": ["x"],
                 "docs": [{"id": "kenya", "text": DOCS["kenya"] + " It has changed."}]})
    return root / "index", _write(root / "qa.jsonl", rows), root


def test_cli_end_to_end(eval_setup):
    index, qa, root = eval_setup
    out = root / "out"
    proc = _run(index, qa, "--modes", "dense,sift", "--max-new-tokens", "4", "--batch", "3", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["questions"] == 5 and report["evaluated"] == 3
    assert [s["id"] for s in report["skipped"]] == ["missing", "stale"]
    assert "not in the index" in report["skipped"][0]["reason"] and "stale" in report["skipped"][1]["reason"]
    assert [r["id"] for r in report["rows"]] == ["q1", "q2", "q3"]
    for mode in ("dense", "sift"):
        stats = report["modes"][mode]
        assert stats["n"] == 3
        for key in ("agreement_first_token", "agreement_answer", "em", "f1", "containment", "kl_first_token",
                    "tile_fraction", "ttft_s"):
            values = [r["modes"][mode][key] for r in report["rows"]]
            lo, hi = stats[key]["ci95"]
            # The mean of the rows' own values; a percentile bootstrap of the mean only draws means of observed
            # values, so its interval lies within their range (a normal approximation would not).
            assert stats[key]["mean"] == pytest.approx(float(np.mean(values)), abs=1e-12), (mode, key)
            assert min(values) - 1e-12 <= lo and hi <= max(values) + 1e-12, (mode, key, values, stats[key])
    # All-ones bits keep every causal tile: SIFT is dense (SPEC section 4's gate), whatever the answers are.
    assert report["modes"]["sift"]["tile_fraction"]["mean"] == 1.0
    assert report["modes"]["sift"]["agreement_first_token"]["mean"] == 1.0
    assert report["modes"]["sift"]["kl_first_token"]["mean"] < 1e-6
    assert report["modes"]["dense"]["agreement_answer"] == {"mean": 1.0, "ci95": [1.0, 1.0]}
    row = report["rows"][0]["modes"]["sift"]
    assert set(row) >= {"answer", "em", "f1", "containment", "tile_fraction", "ttft_s"}
    assert "| sift | 3 |" in (out / "report.md").read_text()
    assert (out / "summary.png").stat().st_size > 1000


def test_cli_oracle_modes(eval_setup):
    """The oracle modes (quality/oracle.py) through the CLI: at coverage 1 the in-context pattern is dense and
    answers like dense; at 0.9 it skips blocks on the questions with two documents."""
    index, qa, root = eval_setup
    out = root / "out-oracle"
    proc = _run(index, qa, "--modes", "dense,oracle@1,oracle@0.9", "--max-new-tokens", "3", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["modes"] == ["dense", "oracle@1", "oracle@0.9"]
    full, sparse = report["modes"]["oracle@1"], report["modes"]["oracle@0.9"]
    assert full["tile_fraction"]["mean"] == 1.0 and full["agreement_answer"]["mean"] == 1.0
    fractions = [r["modes"]["oracle@0.9"]["tile_fraction"] for r in report["rows"]]
    assert fractions[0] < 1.0 and fractions[1] < 1.0, fractions   # q1, q2: two documents each


def test_cli_bad_usage(eval_setup):
    """Exit code 2 and one line, no traceback (in-process: the same click command the console script runs)."""
    index, qa, root = eval_setup
    runner = CliRunner()
    result = runner.invoke(main, [str(index), str(qa), "--modes", "dense,bogus", "--out", str(root / "bad")])
    assert result.exit_code == 2 and result.stderr.startswith("error: --modes"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(main, [str(index), str(qa), "--modes", "dense,hybrid:magic", "--out", str(root / "bad")])
    assert result.exit_code == 2 and "hybrid:<policy>" in result.stderr, result.stderr
    result = runner.invoke(main, [str(index), str(qa), "--modes", "dense,oracle@2", "--out", str(root / "bad")])
    assert result.exit_code == 2 and "oracle@C" in result.stderr, result.stderr
    result = runner.invoke(main, [str(root / "no-index"), str(qa), "--out", str(root / "bad")])
    assert result.exit_code == 2 and "sift-build" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(main, [str(index), str(qa), "--limit", "0", "--out", str(root / "bad")])
    assert result.exit_code == 2  # click's usage error
    assert not (root / "bad").exists()


# ------------------------------------------------------------------------ a batch the engine refuses


class _Engine:
    """Stands in for SiftEngine in `evaluate`: refuses any batch holding a question marked "refuse"."""

    def __init__(self):
        self.index, self.calls = {}, []

    def tokenize(self, request):
        return [("prefix", [1]), ("query", [2])]

    def prefill(self, requests, mode):
        pass

    def generate(self, requests, max_new_tokens, mode):
        self.calls.append((len(requests), mode))
        if any("refuse" in r.query for r in requests):
            raise SiftError("request is too long")
        logits = torch.zeros(len(requests), 4)
        prefill = PrefillResult(logits=logits, ttft_s=(0.5,) * len(requests), stages={}, tile_fraction=0.25,
                                mode=mode, backend="torch", block=16, n_tokens=(2,) * len(requests))
        return GenerateResult(texts=[" Paris"] * len(requests), token_ids=[[7]] * len(requests), prefill=prefill,
                              decode_s=0.0)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The refusal a CLI prints: exit code 2 and one line on stderr, no traceback -> that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_cli_out_that_cannot_be_a_folder_is_refused_before_any_work(eval_setup, tmp_path):
    """--out an existing file, or a path under one: refused at the start (exit 2, one line naming --out), not
    after the whole evaluation with a traceback; sift-serve-demo's --json-out the same."""
    index, qa, _ = eval_setup
    taken = tmp_path / "taken"
    taken.write_text("results of another run\n")
    for out in (taken, taken / "report"):
        line = _one_line_error(_run(index, qa, "--modes", "dense,sift", "--max-new-tokens", "1", "--out", out))
        assert f"--out {out}" in line, line
    assert taken.read_text() == "results of another run\n"
    demo = subprocess.run([str(SIFT_EVAL.with_name("sift-serve-demo")), "--index", str(index), "--json-out",
                           str(taken / "demo.json")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "--json-out" in _one_line_error(demo)


def test_cli_malformed_qa_line_names_the_file_and_the_line(eval_setup, tmp_path):
    index, _, _ = eval_setup
    rows = [{"id": "q1", "question": "Capital of Kenya?", "answers": ["Nairobi"], "docs": [{"id": "kenya",
                                                                                           "text": "Kenya."}]}] * 2
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "q3", "question": \n')
    line = _one_line_error(_run(index, qa, "--out", tmp_path / "out"))
    assert f"QA file {qa} line 3: not valid JSON" in line, line
    assert not (tmp_path / "out").exists()
    array = tmp_path / "qa.json"
    array.write_text("[\n" + json.dumps(rows[0]) + ",\n" + json.dumps(rows[1]) + "\n,]\n")
    with pytest.raises(SiftError, match=rf"QA file {array} line 4: not valid JSON"):
        load_qa(array)


def test_refused_batch_is_rerun_one_by_one():
    items = [QAItem(id=q, question=q, answers=("Paris",), docs=()) for q in ("a", "refuse", "c")]
    engine = _Engine()
    rows, skipped = evaluate(engine, items, ["sift"], batch=2)
    assert [r["id"] for r in rows] == ["a", "c"]
    assert skipped == [{"id": "refuse", "question": "refuse", "reason": "request is too long"}]
    assert rows[0]["modes"]["sift"] == dict(answer="Paris", agreement_first_token=1.0, agreement_answer=1.0, em=1.0,
                                           f1=1.0, containment=1.0, kl_first_token=0.0, tile_fraction=0.25,
                                           ttft_s=0.5)
    # batches [a, refuse] (refused, then a alone and refuse alone), [c]; dense first in each
    assert engine.calls == [(2, "dense"), (1, "dense"), (1, "sift"), (1, "dense"), (1, "dense"), (1, "sift")]


def test_cli_recall_all_ones(eval_setup):
    """--recall over an all-ones index: every own- and cross-document cell falls in a kept tile or page, nothing is
    skipped, and document rows keep all their attention mass."""
    index, qa, root = eval_setup
    out = root / "out-recall"
    proc = _run(index, qa, "--modes", "dense", "--max-new-tokens", "1", "--recall", "--recall-at-block",
                "--block", "32", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    recall = report["recall"]
    assert recall["prompts"] == 3 and (recall["alpha"], recall["beta"], recall["tile"]) == (0.001, 0.01, 16)
    assert recall["block"] == 32 == report["settings"]["block"]
    total = recall["total"]
    assert total["la_recall"] == 1.0 and total["ca_recall"] == 1.0
    assert total["la_sparsity"] == 0.0 and total["ca_sparsity"] == 0.0
    # Each row's fp32 softmax sums to 1 within the rounding of a sum over its keys (these prompts are < 1024 tokens).
    assert total["mass_kept"] == pytest.approx(1.0, abs=rounding_tol(torch.float32, reduction=1024))
    assert total["la_high_cells"] > 0 and total["ca_high_cells"] > 0  # q1 and q2 have two documents
    assert len(recall["layers"]) == 30 and recall["paper"]["la_recall"] == 0.939
    assert "counted at kernel block 32" in (out / "report.md").read_text()
    assert (out / "recall.png").stat().st_size > 1000
