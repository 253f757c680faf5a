"""Pictures of an index (`sift-inspect --plot`): the densities decoded from hand-built bit patterns, the PNGs
written by the command, and a --plot folder that cannot be one."""
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pyarrow as pa
import pytest
import torch

from sift.errors import SiftError
from sift.format import DOCS_SCHEMA, la_nbytes
from sift.plots import FIGURES, index_density

from .test_store import HEADS, LAYERS, TILE, make_index

BIN = Path(sys.executable).parent
LENGTHS = {"a": 37, "b": 100, "c": 16, "d": 1, "e": 250, "f": 63, "g": 17}


def _row(doc_id: str, n_tokens: int, la: bytes, ca: bytes) -> dict:
    return dict(doc_id=doc_id, content_hash="0" * 64, n_tokens=n_tokens, la_bits=la, ca_bits=ca, source=doc_id,
                la_density=[0.0], ca_density=[0.0])


def test_density_of_hand_built_bits():
    """2 layers x 3 heads, tile 16. Document x: 40 tokens = 3 pages, so 6 LA bits (1 byte) and 3 CA bits (1 byte)
    per (layer, head); vector k = layer * 3 + head has its first k LA bits set (k = 0..5) and CA bit 0 set only
    in layer 1, plus a set padding bit in every vector, which must not count. Document y: 16 tokens = 1 page, 1
    bit each, LA set everywhere, CA nowhere."""
    la_x = bytes(((0xFF << (8 - k)) & 0xFF) | 0x01 for k in range(6))      # MSB-first; bit 7 (LSB) is padding
    ca_x = bytes([0b00000001] * 3 + [0b10000001] * 3)
    la_y, ca_y = bytes([0b10000000] * 6), bytes([0b00000000] * 6)
    table = pa.Table.from_pylist([_row("x", 40, la_x, ca_x), _row("y", 16, la_y, ca_y)], schema=DOCS_SCHEMA)

    d = index_density(table, tile=16, n_layers=2, n_heads=3)

    assert d.la_heads.shape == d.ca_heads.shape == (2, 3)
    assert np.allclose(d.la_heads, [[(0 / 6 + 1) / 2, (1 / 6 + 1) / 2, (2 / 6 + 1) / 2],
                                    [(3 / 6 + 1) / 2, (4 / 6 + 1) / 2, (5 / 6 + 1) / 2]])
    assert np.allclose(d.ca_heads, [[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]])
    assert np.allclose(d.doc_la, [15 / 36, 1.0]) and np.allclose(d.doc_ca, [3 / 18, 0.0])
    assert d.tile_fraction == pytest.approx((15 + 6) / (36 + 6))    # kept tiles over all tiles, both documents
    assert d.page_fraction == pytest.approx(3 / (18 + 6))
    assert d.n_tokens.tolist() == [40, 16]


def test_density_of_an_empty_index_and_of_wrong_sizes():
    d = index_density(DOCS_SCHEMA.empty_table(), tile=16, n_layers=2, n_heads=3)
    assert d.la_heads.shape == (2, 3) and d.tile_fraction == 0.0 and len(d.doc_la) == 0
    short = pa.Table.from_pylist([_row("x", 40, b"\x00" * 5, b"\x00" * 6)], schema=DOCS_SCHEMA)
    with pytest.raises(SiftError, match="document x: la_bits holds 5 bytes, expected 6"):
        index_density(short, tile=16, n_layers=2, n_heads=3)


def _expected_heads(rows: dict) -> np.ndarray:
    """[LAYERS, HEADS] mean over documents of each LA vector's share of set bits, decoded bit by bit in Python."""
    per_doc = []
    for r in rows.values():
        p = -(-r["n_tokens"] // TILE)
        n_bits, nbytes = p * (p + 1) // 2, la_nbytes(r["n_tokens"], TILE)
        blob = r["la_bits"]
        per_doc.append([[sum((blob[v * nbytes + b // 8] >> (7 - b % 8)) & 1 for b in range(n_bits)) / n_bits
                         for v in (layer * HEADS + h for h in range(HEADS))] for layer in range(LAYERS)])
    return np.mean(per_doc, axis=0)


def _expected_tile_fraction(rows: dict) -> float:
    """LA bits set over all LA bits of the index (every document, layer and head), decoded bit by bit."""
    kept = total = 0
    for r in rows.values():
        p = -(-r["n_tokens"] // TILE)
        n_bits, nbytes = p * (p + 1) // 2, la_nbytes(r["n_tokens"], TILE)
        blob = r["la_bits"]
        kept += sum((blob[v * nbytes + b // 8] >> (7 - b % 8)) & 1 for v in range(LAYERS * HEADS)
                    for b in range(n_bits))
        total += LAYERS * HEADS * n_bits
    return kept / total


def test_inspect_plot_writes_the_pngs(tmp_path):
    index = tmp_path / "index"
    rows = make_index(index, LENGTHS, shards=3)
    out = tmp_path / "plots" / "new"   # created, parents included

    proc = subprocess.run([str(BIN / "sift-inspect"), str(index), "--plot", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["plots"] == [str(out / name) for name in FIGURES]
    heads = np.asarray(summary["la_density_per_head"])
    assert heads.shape == (LAYERS, HEADS) and np.allclose(heads, _expected_heads(rows), atol=1e-4)
    assert summary["tile_fraction"] == pytest.approx(_expected_tile_fraction(rows), abs=1e-4)

    for name in FIGURES:
        image = mpimg.imread(out / name)            # [height, width, RGBA]
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 500, (name, image.shape)
        assert image[..., :3].std() > 0.05, f"{name} is blank"

    text = subprocess.run([str(BIN / "sift-inspect"), str(index)], capture_output=True, text=True, timeout=300)
    assert f"{summary['tile_fraction']:.1%} of LA tiles" in text.stdout


@pytest.mark.parametrize("case", ["file", "under_a_file"])
def test_plot_to_a_path_that_cannot_be_a_folder(tmp_path, case):
    index = tmp_path / "index"
    make_index(index)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    target = a_file if case == "file" else a_file / "plots"
    proc = subprocess.run([str(BIN / "sift-inspect"), str(index), "--plot", str(target)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --plot") and str(target) in lines[0], proc.stderr
    assert a_file.read_text() == "mine"


def test_random_bits_of_a_long_document():
    """Random bit matrices packed by the kernels' packer: the densities are the shares of the bits drawn."""
    from sift.kernels.bits import pack_msb

    gen = torch.Generator().manual_seed(1)
    p, vectors = 23, LAYERS * HEADS
    la = torch.rand(vectors, p * (p + 1) // 2, generator=gen) < 0.3
    ca = torch.rand(vectors, p, generator=gen) < 0.6
    table = pa.Table.from_pylist([_row("r", p * TILE, pack_msb(la).numpy().tobytes(), pack_msb(ca).numpy().tobytes())],
                                 schema=DOCS_SCHEMA)
    d = index_density(table, tile=TILE, n_layers=LAYERS, n_heads=HEADS)
    assert np.allclose(d.la_heads, la.double().mean(dim=1).reshape(LAYERS, HEADS).numpy())
    assert np.allclose(d.ca_heads, ca.double().mean(dim=1).reshape(LAYERS, HEADS).numpy())


def test_inspect_names_the_guarded_layers_and_heads(tmp_path):
    """`sift-inspect` says which CA vectors an index keeps whole (profile.ca_full_layers / ca_full_heads), and
    says nothing of it for an index without guards."""
    from click.testing import CliRunner

    from sift.pipeline.cli import inspect_main

    make_index(tmp_path / "plain", LENGTHS)
    make_index(tmp_path / "guarded", LENGTHS, profile={"ca_full_layers": [0], "ca_full_heads": [[1, 0], [1, 2]]})
    plain = CliRunner().invoke(inspect_main, [str(tmp_path / "plain")])
    guarded = CliRunner().invoke(inspect_main, [str(tmp_path / "guarded")])
    assert plain.exit_code == 0 and guarded.exit_code == 0, plain.output + guarded.output
    assert "CA kept whole" not in plain.output
    assert "CA kept whole in layers [0]" in guarded.output
    assert "CA kept whole in 2 (layer, head) pairs" in guarded.output
