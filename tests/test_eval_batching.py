"""The answer benchmarks' batching and choices: sift-calibrate's runner generating dense answers --batch questions
per engine call and once per question, and bench/eval_quality.py's choice of a setting at no more tiles than the
paper's defaults on hand-made sweeps."""
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sift.errors import SiftError
from sift.quality.calibrate import DEFAULT, _Runner, within_tiles
from sift.quality.qa import QAItem

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from eval_quality import within_default_tiles  # noqa: E402  (bench/eval_quality.py)


class _Engine:
    """An engine stand-in: records each generate call's questions and answers each question with its own id."""

    block = 16

    def __init__(self):
        self.calls = []

    def generate(self, requests, max_new_tokens, mode):
        names = [re.search(r"Question: (q\d+)", r.query).group(1) for r in requests]
        self.calls.append((mode, names))
        return SimpleNamespace(token_ids=[[int(n[1:])] * max_new_tokens for n in names])


def _runner(batch: int) -> _Runner:
    runner = object.__new__(_Runner)   # no model: only the dense-answer bookkeeping is under test
    runner.batch, runner.max_new_tokens, runner._dense = batch, 2, {}
    return runner


def _items(n: int) -> list[QAItem]:
    return [QAItem(f"id{k}", f"q{k}", ("a",), (("d", "text"),)) for k in range(n)]


def test_dense_answers_in_batches_and_once_per_question():
    runner, engine, items = _runner(2), _Engine(), _items(5)
    assert runner.dense(engine, items[:3]) == [[0, 0], [1, 1], [2, 2]]
    assert engine.calls == [("dense", ["q0", "q1"]), ("dense", ["q2"])]
    # known answers are not generated again; the unknown ones are, still at most `batch` per call
    assert runner.dense(engine, items) == [[k, k] for k in range(5)]
    assert engine.calls[2:] == [("dense", ["q3", "q4"])]


def test_runner_refuses_a_bad_batch():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SiftError, match="batch"):
            _Runner("unused", "cpu", 2, print, batch=bad)


def _point(label, agreement, tiles, first=None):
    return dict(label=label, agreement=agreement, agreement_first_token=agreement if first is None else first,
                tile_fraction=tiles)


def test_within_tiles_best_agreement_at_most_the_reference_tiles():
    paper = DEFAULT.label
    rows = [_point(paper, 0.80, 0.757), _point("t64-reader0.999", 0.97, 0.80),   # too many tiles
            _point("t64-reader0.998", 0.90, 0.75), _point("t64-reader0.995", 0.90, 0.70, first=0.95),
            _point("t64-reader0.99", 0.85, 0.65)]
    # 0.998 and 0.995 tie on agreement; 0.995 agrees on the first token more often
    assert within_tiles(rows, paper)["label"] == "t64-reader0.995"
    rows[3]["agreement_first_token"] = 0.90       # a full tie: the fewer tiles
    assert within_tiles(rows, paper)["label"] == "t64-reader0.995"
    rows[3]["tile_fraction"], rows[2]["tile_fraction"] = 0.75, 0.74
    assert within_tiles(rows, paper)["label"] == "t64-reader0.998"
    assert within_tiles(rows[1:], paper) is None                       # the reference not swept
    assert within_tiles([_point(paper, 0.8, 0.7), _point("t64-reader0.999", 1.0, 0.8)], paper) is None


def test_within_default_tiles_reports_the_held_out_figures():
    paper = DEFAULT.label
    result = dict(points=[_point(paper, 0.80, 0.757), _point("t64-reader0.995", 0.90, 0.70)],
                  held_out_results={paper: dict(agreement_answer=0.82, tile_fraction=0.757)})
    out = within_default_tiles(result)
    assert out["chosen"] == "t64-reader0.995" and out["chosen_held_in"] == dict(agreement=0.90, tile_fraction=0.70)
    assert out["chosen_held_out"] is None                              # not evaluated held out
    assert out["reference_held_out"] == dict(agreement_answer=0.82, tile_fraction=0.757)
    result["held_out_results"]["t64-reader0.995"] = dict(agreement_answer=0.9, tile_fraction=0.71)
    assert within_default_tiles(result)["chosen_held_out"] == dict(agreement_answer=0.9, tile_fraction=0.71)
    result["points"][1]["tile_fraction"] = 0.8
    assert within_default_tiles(result)["chosen"] is None
    assert within_default_tiles(dict(points=result["points"][1:])) is None


def test_runner_gives_each_engine_its_kv_pool(monkeypatch):
    """--kv-gib: every engine the runner makes gets that pool, not the engine's share of the free GPU memory,
    which evaluations sharing one GPU would each claim."""
    import sift.runtime.engine as engine_module
    import sift.runtime.store as store_module

    made = []
    monkeypatch.setattr(store_module.SiftIndex, "open", staticmethod(lambda path, device: ("index", path)))
    monkeypatch.setattr(engine_module, "SiftEngine", lambda *args, **kwargs: made.append(kwargs) or kwargs)
    for kv_bytes in (3 << 30, None):
        runner = _runner(1)
        runner.hf, runner.tokenizer, runner.device, runner.block, runner.kv_bytes = "hf", "tok", "cpu", 16, kv_bytes
        runner.engine(Path("index"))
        assert made[-1]["kv_cache_bytes"] == kv_bytes and made[-1]["block"] == 16
