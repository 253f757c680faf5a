"""sift-calibrate (quality/calibrate.py): the Pareto front and the choice on hand-made fronts, settings parsed
and written as TOML the builder takes, the mass LA criterion of the profiling reference against a brute force on
full attention matrices, and the long-document QA construction on small hand-written sources."""
import gzip
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

import pytest
import torch

from sift.errors import SiftError
from sift.kernels.bits import tril_to_square, unpack_msb
from sift.kernels.profile_ref import profile_layer_ref
from sift.pipeline.config import load_config
from sift.quality.calibrate import (DEFAULT, DEFAULT_GRID, Setting, choose, guard_heads, guard_layers, pareto,
                                    parse_setting)
from sift.quality.qa import load_qa, long_documents, nq_long_documents, write_jsonl


SIFT_CALIBRATE = Path(sys.executable).with_name("sift-calibrate")
SAMPLE = Path(__file__).resolve().parent / "data" / "long_docs_sample.jsonl"   # three questions


def _refusal(*args, cwd) -> str:
    """sift-calibrate refusing its arguments: exit 2 and one line on stderr, no traceback -> that line."""
    proc = subprocess.run([str(SIFT_CALIBRATE), *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=cwd)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_cli_refuses_bad_out_settings_and_held_in_before_any_work(tmp_path):
    """A file as --out, a tile the builder refuses, and more held-in questions than the file has are each one
    line and exit 2 before anything is built or written (no folder is made)."""
    taken = tmp_path / "taken"
    taken.write_text("x\n")
    assert f"--out {taken}" in _refusal(SAMPLE, "--out", taken, cwd=tmp_path)
    line = _refusal(SAMPLE, "--out", tmp_path / "cal", "--setting", "tile=7", cwd=tmp_path)
    assert "--setting 'tile=7': tile = 7 is not one of 16, 32, 64, 128" in line, line
    assert not (tmp_path / "cal").exists()
    line = _refusal(SAMPLE, "--out", tmp_path / "cal", "--held-in", "5", cwd=tmp_path)
    assert f"{SAMPLE} has 3 questions: more than --held-in 5" in line and "None" not in line, line
    assert not (tmp_path / "cal").exists()


def _row(label, tiles, agreement):
    return dict(label=label, tile_fraction=tiles, agreement=agreement)


# A toy front: "b" is the sparsest at >= 95%; "c" is sparser but below the target; "d" is dominated by "b";
# "e" ties "b" on tiles with lower agreement.
TOY = [_row("a", 0.99, 1.00), _row("b", 0.80, 0.96), _row("c", 0.50, 0.70), _row("d", 0.85, 0.95),
       _row("e", 0.80, 0.95), _row("f", 0.30, 0.40)]


def test_choose_picks_sparsest_meeting_target():
    assert choose(TOY, 0.95)["label"] == "b"
    assert choose(TOY, 0.97)["label"] == "a"
    assert choose(TOY, 0.5)["label"] == "c"
    assert choose(TOY, 1.01) is None


def test_pareto_front():
    assert [r["label"] for r in pareto(TOY)] == ["f", "c", "b", "a"]
    assert pareto([_row("x", 0.5, 0.5), _row("y", 0.5, 0.5)]) == [_row("x", 0.5, 0.5), _row("y", 0.5, 0.5)]


def test_held_out_settings_front_or_every_swept_one():
    from sift.quality.calibrate import held_out_settings

    a, b, c = Setting(tile=16), Setting(tile=32), Setting(tile=16, alpha=0.01)
    rows = [dict(setting=asdict(s), label=s.label, tile_fraction=t, agreement=g)
            for s, t, g in ((a, 0.5, 0.9), (b, 0.7, 0.8), (c, 0.9, 1.0))]  # b is dominated by a
    front = pareto(rows)
    assert held_out_settings(rows, front) == [DEFAULT, a, c]
    assert held_out_settings(rows, front, every=True) == [DEFAULT, a, b, c]
    assert held_out_settings([dict(setting=asdict(DEFAULT))] * 2, [], every=True) == [DEFAULT]


def test_parse_setting_and_toml_taken_by_the_builder(tmp_path):
    s = parse_setting("tile=16, alpha=0.0003,beta=0.005,gamma=0.05")
    assert s == Setting(tile=16, alpha=0.0003, beta=0.005, gamma=0.05)
    m = parse_setting("tile=32,criterion=mass,coverage=0.99")
    assert (m.la_criterion, m.la_coverage, m.alpha) == ("mass", 0.99, DEFAULT.alpha)
    assert m.label == "t32-mass0.99-b0.01-g0.1" and s.label == "t16-a0.0003-b0.005-g0.05"
    for bad in ("tile=16,delta=1", "tile=x", "criterion=median", "alpha", "tile=7", "beta=1.5", "coverage=0"):
        with pytest.raises(SiftError):
            parse_setting(bad)
    for setting in (s, m, *DEFAULT_GRID):
        path = tmp_path / f"{setting.label}.toml"
        path.write_text(setting.toml("smollm2-135m-instruct"))
        profile = load_config(path).profile
        assert (profile.tile, profile.alpha, profile.beta, profile.gamma, profile.la_criterion,
                profile.la_coverage) == (setting.tile, setting.alpha, setting.beta, setting.gamma,
                                         setting.la_criterion, setting.la_coverage)
    assert DEFAULT == Setting(**{k: getattr(load_config().profile, k) for k in Setting.__dataclass_fields__})


# ------------------------------------------------------------------------------------ the mass criterion


def _mass_brute_force(q, k, *, n_prefix, tile, coverage, scale):
    """Full softmax, then per document row the smallest set of key tiles holding `coverage` of its document
    mass, found by trying sets in decreasing order of tile mass; OR over the rows of each query tile."""
    hq, lp, _ = q.shape
    k = k.repeat_interleave(hq // k.shape[0], dim=0)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(lp, lp, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.softmax(s, dim=-1)[:, n_prefix:, n_prefix:]
    n = lp - n_prefix
    p = -(-n // tile)
    kept = torch.zeros(hq, p, p, dtype=torch.bool)
    for h in range(hq):
        for row in range(n):
            masses = [float(a[h, row, j * tile:(j + 1) * tile].sum()) for j in range(p)]
            total, held = sum(masses), 0.0
            for j in sorted(range(p), key=lambda j: -masses[j]):
                if held >= coverage * total or masses[j] == 0:
                    break
                kept[h, row // tile, j] = True
                held += masses[j]
    return kept | torch.eye(p, dtype=torch.bool) | (torch.arange(p) == 0)[None, :]


@pytest.mark.parametrize("n_doc,tile,coverage", [(70, 16, 0.9), (64, 32, 0.5), (45, 16, 0.99)])
def test_mass_criterion_equals_brute_force(n_doc, tile, coverage):
    g = torch.Generator().manual_seed(n_doc)
    n_prefix = 1
    q = torch.randn(4, n_prefix + n_doc, 16, generator=g) * 2
    k = torch.randn(2, n_prefix + n_doc, 16, generator=g) * 2
    bits, _ = profile_layer_ref(q, k, scale=0.25, n_prefix=n_prefix, tile=tile, alpha=0.5, beta=0.01, gamma=0.1,
                                criterion="mass", coverage=coverage, block_bytes=4 * 4 * (n_prefix + n_doc) * tile)
    p = -(-n_doc // tile)
    got = tril_to_square(unpack_msb(bits.la, p * (p + 1) // 2), p)
    want = _mass_brute_force(q, k, n_prefix=n_prefix, tile=tile, coverage=coverage, scale=0.25) & torch.ones(
        p, p, dtype=torch.bool).tril()
    print(f"kept {int(got.sum())} of {4 * p * (p + 1) // 2} tiles, brute force {int(want.sum())}")
    assert torch.equal(got, want)
    threshold, _ = profile_layer_ref(q, k, scale=0.25, n_prefix=n_prefix, tile=tile, alpha=0.5, beta=0.01,
                                     gamma=0.1)
    assert torch.equal(threshold.ca, bits.ca)  # CA does not depend on the LA criterion


def test_mass_criterion_refused_by_triton_and_bad_values():
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler

    from .helpers import smollm2

    model, tokenizer = smollm2()
    with pytest.raises(SiftError, match="torch backend only"):
        Profiler(model, tokenizer, ProfileConfig(la_criterion="mass"), "triton")
    assert model.config._attn_implementation == "sdpa"  # refused before touching the shared model

    with pytest.raises(SiftError, match="la_criterion"):
        ProfileConfig(la_criterion="median")
    with pytest.raises(SiftError, match="la_coverage"):
        ProfileConfig(la_coverage=0.0)
    q = torch.randn(2, 20, 8)
    with pytest.raises(ValueError, match="criterion"):
        profile_layer_ref(q, q, scale=1.0, n_prefix=1, tile=16, alpha=0.1, beta=0.1, gamma=0.1, criterion="x")


def test_profile_key_ignores_coverage_under_threshold():
    from dataclasses import replace

    base = load_config()
    same = replace(base, profile=replace(base.profile, la_coverage=0.5))
    mass = replace(base, profile=replace(base.profile, la_criterion="mass"))
    mass_other = replace(mass, profile=replace(mass.profile, la_coverage=0.5))
    keys = {c.profile_key("fp", 1) for c in (base, same, mass, mass_other)}
    assert base.profile_key("fp", 1) == same.profile_key("fp", 1) and len(keys) == 3


# -------------------------------------------------------------------------------------- long documents


def test_long_documents_construction(tmp_path):
    context = [["Gold A", ["Alpha is ", "the first."]], ["Other", ["A distractor."]], ["Gold B", ["Beta."]],
               ["Other 2", ["Unused."]]]
    hotpot = [{"_id": "q1", "question": "Which?", "answer": "Alpha", "context": context,
               "supporting_facts": [["Gold A", 0], ["Gold B", 0]]}]
    leads = {f"Lead {i}": {"extract": f"Lead text number {i}. " * 5, "topic": "T1" if i % 2 else "T2"}
             for i in range(40)}
    leads["Lead 3"]["extract"] = "This lead mentions Alpha and must be skipped."
    leads["Other"] = {"extract": "A lead titled like a question paragraph.", "topic": "T1"}
    (tmp_path / "h.json").write_text(json.dumps(hotpot))
    with gzip.open(tmp_path / "w.json.gz", "wt") as f:
        json.dump(leads, f)
    items = long_documents(tmp_path / "h.json", tmp_path / "w.json.gz", doc_chars=400)
    assert len(items) == 1 and items[0].answers == ("Alpha",)
    docs = dict(items[0].docs)
    assert list(docs) == ["Gold A (long)", "Other (long)", "Gold B (long)"]  # two gold, first distractor, in order
    for title, paragraph in (("Gold A", "Alpha is the first."), ("Other", "A distractor."), ("Gold B", "Beta.")):
        text = docs[f"{title} (long)"]
        assert paragraph in text.split("\n\n") and 400 <= len(text) < 400 + 200
        assert "must be skipped" not in text and "titled like" not in text
    write_jsonl(items, tmp_path / "long.jsonl")
    again = load_qa(tmp_path / "long.jsonl")[0]
    assert again == items
    assert long_documents(tmp_path / "h.json", tmp_path / "w.json.gz", doc_chars=400) == items  # deterministic


def test_nq_long_documents_construction(tmp_path):
    def row(q, answers, title, text):
        return {"question": q, "answers": answers, "ctxs": [{"title": title, "text": text, "hasanswer": True}]}

    rows = [row("who wrote alpha", ["Ann Lee"], "Alpha", "Alpha was written by Ann Lee."),
            row("where is beta", ["Paris"], "Beta", "Beta is in Paris. Ann Lee lived there."),  # mentions q1's answer
            row("when was gamma", ["1901"], "Gamma", "Gamma dates from 1901."),
            row("what is delta", ["a river"], "Alpha", "Another passage titled Alpha: delta is a river."),
            row("who is epsilon", ["Bo"], "Epsilon", "Epsilon is Bo.")]
    leads = {f"Lead {i}": {"extract": f"Lead text number {i}. " * 5, "topic": "T1" if i % 2 else "T2"}
             for i in range(40)}
    leads["Lead 3"]["extract"] = "This lead mentions Ann Lee and must be skipped for question 1."
    leads["Gamma"] = {"extract": "A lead titled like a passage of the question.", "topic": "T1"}
    with gzip.open(tmp_path / "nq.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with gzip.open(tmp_path / "w.json.gz", "wt") as f:
        json.dump(leads, f)
    items = nq_long_documents(tmp_path / "nq.jsonl.gz", tmp_path / "w.json.gz", doc_chars=400)
    assert [i.id for i in items] == [f"nq-{k}" for k in range(1, 6)] and items[0].answers == ("Ann Lee",)
    # question 1: its passage, and the next passages that neither mention "Ann Lee" nor share its title
    titles = [doc_id.split(" [")[0] for doc_id, _ in items[0].docs]
    assert sorted(titles) == ["Alpha", "Epsilon", "Gamma"]
    for doc_id, text in items[0].docs:
        assert doc_id.endswith(" (long)") and 400 <= len(text) < 400 + 200
        assert "must be skipped" not in text and "titled like" not in text
    gold = [text for _, text in items[0].docs if "Alpha was written by Ann Lee." in text.split("\n\n")]
    assert len(gold) == 1 and sum("Ann Lee" in text for _, text in items[0].docs) == 1
    # the last question wraps around to the first ones
    assert sorted(d.split(" [")[0] for d, _ in items[4].docs) == ["Alpha", "Beta", "Epsilon"]
    # a doc_id names one text across questions, even where a title has two passages
    texts = {}
    for item in items:
        for doc_id, text in item.docs:
            assert texts.setdefault(doc_id, text) == text
    assert len({d for d in texts if d.startswith("Alpha [")}) >= 2
    short = nq_long_documents(tmp_path / "nq.jsonl.gz", tmp_path / "w.json.gz", doc_chars=0, limit=2)
    assert len(short) == 2 and "Alpha was written by Ann Lee." in dict(short[0].docs).values()
    assert nq_long_documents(tmp_path / "nq.jsonl.gz", tmp_path / "w.json.gz", doc_chars=400) == items
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in [rows[0], {"question": "no passage", "answers": ["x"]}])
    with pytest.raises(SiftError, match="row 2: each row needs a 'question' string and 'ctxs'"):
        nq_long_documents(tmp_path / "bad.jsonl.gz", tmp_path / "w.json.gz", doc_chars=400)


def test_long_documents_sample_in_repository():
    from pathlib import Path

    items, fmt = load_qa(Path(__file__).parent / "data" / "long_docs_sample.jsonl")
    assert fmt == "jsonl" and len(items) == 3
    assert all(len(text) >= 5400 for item in items for _, text in item.docs)


# ------------------------------------------------------------------------- the floor and the whole flow


def test_greedy_equals_transformers_generate():
    """`greedy` (the floor's other dense) against transformers' own generate, eos included and stopping there."""
    from sift.quality.calibrate import greedy

    from .helpers import smollm2

    model, tokenizer = smollm2()
    prompt = tokenizer("The capital of France is", add_special_tokens=True).input_ids
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert greedy(model, prompt, 8, set()) == ref.tolist()
    first = ref[0].item()  # an eos set holding the first token stops there, keeping it (the engine's convention)
    assert greedy(model, prompt, 8, {first}) == [first]


def _copying_builder(source):
    """A `calibrate_items(build=...)` stand-in: every setting gets a copy of one ready index (the flow is under
    test here, not the bits)."""
    import shutil

    def build(setting, corpus, index, model):
        assert (corpus / "docs.jsonl").exists()
        shutil.copytree(source, index, dirs_exist_ok=True)
    return build


def test_calibrate_items_flow_and_floor(tmp_path):
    """The sweep, front, choice, held-out reports (defaults and the front included) and the floor, end to end
    on CPU over an all-ones index: SIFT computes every tile, so it agrees with dense everywhere, and fp32 dense
    through the engine agrees with transformers' fp32 greedy answers on every question."""
    from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
    from sift.quality.calibrate import calibrate_items
    from sift.quality.qa import QAItem

    from .helpers import smollm2
    from .test_engine import write_index
    from .test_eval import DOCS, QUESTIONS

    model, tokenizer = smollm2()
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for d, t in DOCS.items()}
    write_index(tmp_path / "ready", model, fingerprint(resolve_model_dir(DEFAULT_MODEL)), ids, tile=16)
    items = [QAItem(q["id"], q["question"], (q["answers"][0],), tuple((d, DOCS[d]) for d in q["docs"]))
             for q in QUESTIONS]
    settings = [Setting(tile=16), Setting(tile=16, alpha=0.01)]
    seen = []
    result = calibrate_items(items, tmp_path / "cal", name="toy.jsonl", settings=settings, held_in=2, target=0.95,
                             model=DEFAULT_MODEL, device="cpu", max_new_tokens=3, held_out_front=True,
                             build=_copying_builder(tmp_path / "ready"), checkpoint=seen.append)
    # A checkpoint after the sweep, then one after each held-out setting, each with what was measured by then.
    assert [len(c.get("held_out_results", {})) for c in seen] == list(range(len(result["held_out_results"]) + 1))
    assert all(c["complete"] is False and c["points"] == result["points"] for c in seen)
    assert seen[-1]["held_out_results"] == result["held_out_results"]
    assert result["dtype"] == "float32" and result["held_in"] == 2 and result["held_out"] == 1
    assert [p["agreement"] for p in result["points"]] == [1.0, 1.0]
    assert all(p["tile_fraction"] == 1.0 for p in result["points"])
    assert result["chosen"]["label"] in {s.label for s in settings}
    assert set(result["held_out_results"]) == {DEFAULT.label, *(s.label for s in settings)}
    assert all(r["agreement_answer"] == 1.0 and r["n"] == 1 for r in result["held_out_results"].values())
    assert set(result["floor"]) == {"float32", "bfloat16"}
    assert result["floor"]["float32"] == {"n": 2, "agreement": 1.0, "agreement_first_token": 1.0}
    assert result["target_above_floor"] is False
    # The bfloat16 floor from transformers' own generate: the engine's fp32 dense answers equal transformers'
    # fp32 greedy ones (above), so the floor is how often bf16 greedy equals fp32 greedy on the held-in prompts.
    # (The bf16 model is loaded as bf16, as the floor's is: a cast model would also round RoPE's frequencies.)
    from sift.model import load_model
    from sift.runtime import SiftEngine

    bf16 = load_model(DEFAULT_MODEL, dtype="bfloat16")[0]
    prompts = [SiftEngine(model, tokenizer, None).prompt_ids(item.request()) for item in items[:2]]

    def greedy(m, prompt):
        x = torch.tensor([prompt])
        out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False)
        return out[0, len(prompt):].tolist()

    same = [greedy(bf16, p) == greedy(model, p) for p in prompts]
    assert result["floor"]["bfloat16"]["agreement"] == sum(same) / len(same)
    assert result["held_out_floor"]["float32"]["n"] == 1
    saved = json.loads((tmp_path / "cal" / "front.json").read_text())
    assert saved["floor"] == result["floor"] and (tmp_path / "cal" / "front.png").stat().st_size > 1000
    assert (tmp_path / "cal" / "calibrated.toml").exists()


# ------------------------------------------------------------------------------------- guarded layers


def test_ca_full_layers_profile_and_setting():
    """`ca_full_layers` sets every CA bit of those layers (trailing bits of the last byte 0, as SPEC section 2
    packs them) and changes nothing else; the setting's label, TOML and --setting syntax carry it."""
    from sift.pipeline.config import ProfileConfig
    from sift.pipeline.profiler import Profiler

    from .helpers import smollm2, wiki_texts

    model, tokenizer = smollm2()
    ids = tokenizer(wiki_texts(1)[0][:700], add_special_tokens=False).input_ids
    previous = model.config._attn_implementation  # the model is shared: give it back as it came
    try:
        plain = Profiler(model, tokenizer, ProfileConfig(tile=16, gamma=0.3), "torch").profile(ids)
        guarded_cfg = ProfileConfig(tile=16, gamma=0.3, ca_full_layers=(2, 29))
        guarded = Profiler(model, tokenizer, guarded_cfg, "torch").profile(ids)
        heads_cfg = ProfileConfig(tile=16, gamma=0.3, ca_full_layers=(29,), ca_full_heads=((5, 4), (5, 1), (29, 0)))
        by_head = Profiler(model, tokenizer, heads_cfg, "torch").profile(ids)
    finally:
        model.set_attn_implementation(previous)
    cfg = model.config
    layers, heads, pages = cfg.num_hidden_layers, cfg.num_attention_heads, -(-len(ids) // 16)
    nbytes = -(-pages // 8)
    ca_plain = np.frombuffer(plain.ca, np.uint8).reshape(layers, heads, nbytes)
    ca_guarded = np.frombuffer(guarded.ca, np.uint8).reshape(layers, heads, nbytes)
    full = [0xFF] * (pages // 8) + ([(0xFF << (8 - pages % 8)) & 0xFF] if pages % 8 else [])
    assert (ca_guarded[[2, 29]] == np.array(full, np.uint8)).all()
    others = [layer for layer in range(layers) if layer not in (2, 29)]
    assert (ca_guarded[others] == ca_plain[others]).all() and guarded.la == plain.la
    assert (ca_plain[[2, 29]] != ca_guarded[[2, 29]]).any()  # gamma 0.3 drops pages there: the test can fail
    # ca_full_heads: only those (layer, head) vectors whole; with ca_full_layers both apply
    ca_heads = np.frombuffer(by_head.ca, np.uint8).reshape(layers, heads, nbytes)
    whole = np.zeros((layers, heads), bool)
    whole[29] = whole[5, 1] = whole[5, 4] = True
    assert (ca_heads[whole] == np.array(full, np.uint8)).all() and by_head.la == plain.la
    assert (ca_heads[~whole] == ca_plain[~whole]).all()
    assert (ca_plain[5, [1, 4]] != ca_heads[5, [1, 4]]).any()
    with pytest.raises(SiftError, match="ca_full_layers"):
        Profiler(model, tokenizer, ProfileConfig(ca_full_layers=(layers,)), "torch")
    with pytest.raises(SiftError, match=r"ca_full_heads \[\[0, 9\]\]"):
        Profiler(model, tokenizer, ProfileConfig(ca_full_heads=((0, heads),)), "torch")
    assert model.config._attn_implementation == previous  # refused before touching the shared model

    setting = parse_setting("tile=16,gamma=0.3,ca_full=29/2/0/1")
    assert setting.ca_full_layers == (0, 1, 2, 29) and setting.label == "t16-a0.001-b0.01-g0.3-ca0-2.29"
    assert load_config_text(setting.toml("m")).profile.ca_full_layers == (0, 1, 2, 29)
    assert Setting(**json.loads(json.dumps(asdict(setting)))) == setting  # front.json round trip
    with pytest.raises(SiftError, match="layers separated by /"):
        parse_setting("ca_full=1;2")

    by_head = parse_setting("tile=16,gamma=0.3,ca_heads=5.4/0.2/5.1")
    assert by_head.ca_full_heads == ((0, 2), (5, 1), (5, 4)) and by_head.guarded and not Setting().guarded
    assert by_head.label.startswith("t16-a0.001-b0.01-g0.3-cah3.") and by_head.label != Setting(
        tile=16, gamma=0.3, ca_full_heads=((0, 2), (5, 1))).label
    assert load_config_text(by_head.toml("m")).profile.ca_full_heads == ((0, 2), (5, 1), (5, 4))
    assert Setting(**json.loads(json.dumps(asdict(by_head)))) == by_head
    with pytest.raises(SiftError, match="layer.head pairs"):
        parse_setting("ca_heads=5")


def load_config_text(text):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(text)
        return load_config(path)


def test_guard_layers():
    lost = [0.0, 0.02, None, 0.005, 0.011]
    assert guard_layers(lost, 0.01) == (1, 4)
    assert guard_layers(lost, 0.001) == (1, 3, 4)
    assert guard_layers(lost, 0.5) == ()


def test_guard_heads():
    lost = [[0.0, 0.02, 0.005], [None, None, None], [0.011, 0.0, 0.2]]
    assert guard_heads(lost, 0.01) == ((0, 1), (2, 0), (2, 2))
    assert guard_heads(lost, 0.001) == ((0, 1), (0, 2), (2, 0), (2, 2))
    assert guard_heads(lost, 0.5) == ()


def test_guard_sweeps_twins_with_the_layers_losing_mass(tmp_path):
    """`calibrate_items(guard_ca=...)`: over an index whose CA bits are all 0 (LA all 1), every layer's document
    rows lose the mass they put on earlier documents, so the guard keeps CA whole in every layer that has
    cross-document cells; the twin is built (here: all ones) and swept beside the base setting."""
    from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
    from sift.quality.calibrate import calibrate_items
    from sift.quality.qa import QAItem

    from .helpers import smollm2
    from .test_engine import ones_bits, write_index
    from .test_eval import DOCS, QUESTIONS

    model, tokenizer = smollm2()
    cfg = model.config
    vectors = cfg.num_hidden_layers * cfg.num_attention_heads
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for d, t in DOCS.items()}
    no_ca = {}
    for d, x in ids.items():
        la, ca = ones_bits(len(x), 16, vectors)
        no_ca[d] = (la, bytes(len(ca)))
    fp = fingerprint(resolve_model_dir(DEFAULT_MODEL))
    write_index(tmp_path / "no_ca", model, fp, ids, tile=16, bits=no_ca)
    write_index(tmp_path / "ones", model, fp, ids, tile=16)
    built = []

    def build(setting, corpus, index, model_name):
        import shutil

        built.append(setting)
        shutil.copytree(tmp_path / ("ones" if setting.guarded else "no_ca"), index, dirs_exist_ok=True)

    items = [QAItem(q["id"], q["question"], (q["answers"][0],), tuple((d, DOCS[d]) for d in q["docs"]))
             for q in QUESTIONS if len(q["docs"]) > 1]
    result = calibrate_items(items, tmp_path / "cal", name="toy.jsonl", settings=[Setting(tile=16, gamma=0.5)],
                             held_in=len(items), target=None, model=DEFAULT_MODEL, device="cpu", max_new_tokens=2,
                             floor=False, guard_ca=(0.001,), guard_prompts=1, guard_by=("layer", "head"), block=32,
                             guard_at_block=True, build=build)
    info = result["guard"]["t16-a0.001-b0.01-g0.5"]
    # no CA page is kept, so none is computed at the engine's block either: all cross-document mass is lost
    assert info["prompts"] == 1 and info["block"] == 32 and len(info["ca_mass_lost"]) == cfg.num_hidden_layers
    assert all(lost > 0.001 for lost in info["ca_mass_lost"])
    assert info["guards"]["0.001"] == tuple(range(cfg.num_hidden_layers))
    assert [s.ca_full_layers for s in built[:2]] == [(), tuple(range(cfg.num_hidden_layers))]
    base, twin, head_twin = result["points"]
    assert twin["label"] == f"t16-a0.001-b0.01-g0.5-ca0-{cfg.num_hidden_layers - 1}"
    assert twin["tile_fraction"] == 1.0 > base["tile_fraction"] and twin["agreement"] == 1.0
    # by head: the pairs are exactly those whose measured per-head loss is above eps, and the twin is swept
    heads_lost = np.array(info["heads_ca_mass_lost"], dtype=float)
    assert heads_lost.shape == (cfg.num_hidden_layers, cfg.num_attention_heads)
    assert np.allclose(heads_lost.mean(axis=1), info["ca_mass_lost"])
    expected = tuple((int(l), int(h)) for l, h in zip(*np.nonzero(heads_lost > 0.001)))
    assert 0 < len(expected) and info["guards_heads"]["0.001"] == expected == built[2].ca_full_heads
    assert head_twin["label"] == built[2].label and Setting(**head_twin["setting"]).ca_full_heads == expected
