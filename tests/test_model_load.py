"""`sift.model.load_model(identity=False)` (what a profiling actor calls: no fingerprint) and `weight_files` (what the
builder's page-cache prefetch reads)."""
import json

import torch
from safetensors.torch import save_file

from sift.model import DEFAULT_MODEL, load_model, weight_files


def test_load_model_without_identity_is_the_same_model():
    model, _, identity = load_model(DEFAULT_MODEL, identity=False)
    ref, _, ref_identity = load_model(DEFAULT_MODEL)
    assert identity is None and ref_identity is not None
    a, b = dict(ref.named_parameters()), dict(model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_weight_files_single_sharded_and_none(tmp_path):
    assert weight_files(tmp_path) is None
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    shards = {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
              "c": "model-00001-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    assert [f.name for f in weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
