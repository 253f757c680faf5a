"""How a build reports profiling: one line per shard in a log file, one bar in a terminal. (A whole build's
stderr, with no TTY, is checked in tests/test_build.py: one line per shard, none of Ray's INFO logs.)"""
import io
import re

from sift.pipeline.cli import _ProgressBar
from sift.pipeline.job import ProgressLines

LINE = re.compile(r"sift-build: profiled (\d+)/4 documents, (\d+)/300 tokens \([\d.]+ docs/s, \d+ tokens/s, "
                  r"ETA (\d+:\d\d:\d\d|-)\)$")


def test_one_line_per_shard():
    lines = []
    progress = ProgressLines(lines.append)
    progress.start(4, 300)
    for documents, tokens in ((2, 100), (1, 0), (1, 200)):   # the second shard's one document failed
        progress.shard(documents, tokens)
    progress.close()
    assert len(lines) == 3, lines
    found = [LINE.match(line) for line in lines]
    assert all(found), lines
    assert [(int(m[1]), int(m[2])) for m in found] == [(2, 100), (3, 100), (4, 300)]
    assert found[-1][3] == "0:00:00"


def test_bar_counts_documents_and_tokens(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bar = _ProgressBar()
    bar.start(4, 300)
    bar.shard(3, 100)
    bar.shard(1, 200)
    bar.close()
    last = err.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "profiled 4/4 documents" in last and "100%" in last and "300/300 tokens" in last, last
    assert "tokens/s" in last and "docs/s" in last
