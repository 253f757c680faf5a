"""`sift.model.load_model` and `read_weights`: the model built around the weights read onto the device equals what
transformers' own loader gives; sharded checkpoints of every dtype; a damaged file is one clear SiftError."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sift.errors import SiftError
from sift.model import DEFAULT_MODEL, default_model_dir, load_model, read_weights, weight_files


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_equals_transformers_own_loader(dtype):
    """Reference: transformers' from_pretrained of the same folder (its own reader of the same files)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype),
                                               attn_implementation="sdpa").eval()
    model, _, identity = load_model(DEFAULT_MODEL, dtype=dtype, identity=False)
    assert identity is None
    assert _same(dict(ref.named_parameters()), dict(model.named_parameters()))
    assert _same(dict(ref.named_buffers()), dict(model.named_buffers()))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the config
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    assert model.config.to_dict() == ref.config.to_dict() and model.name_or_path == ref.name_or_path
    assert not model.training


def test_read_weights_sharded_all_dtypes(tmp_path):
    """Two files named by an index, every safetensors dtype torch has, 0-d and empty tensors; the conversion of
    the floats. Reference: safetensors' load_file."""
    g = torch.Generator().manual_seed(0)
    first = {"a.f32": torch.randn(33, 17, generator=g), "a.bf16": torch.randn(700, generator=g).bfloat16(),
             "a.f16": torch.randn(5, 3, 41, generator=g).half(), "a.scalar": torch.tensor(3.5),
             "a.empty": torch.zeros(0, 4)}
    second = {"b.i64": torch.randint(-2**40, 2**40, (129,), generator=g),
              "b.i8": torch.randint(-128, 127, (1001,), generator=g, dtype=torch.int8),
              "b.u8": torch.randint(0, 255, (999,), generator=g, dtype=torch.uint8),
              "b.bool": torch.rand(77, generator=g) > 0.5, "b.f64": torch.randn(300, generator=g, dtype=torch.float64),
              "b.f8": torch.randn(2000, generator=g).to(torch.float8_e4m3fn)}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    files = weight_files(tmp_path)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    got = read_weights(files, "cpu")
    want = {**load_file(files[0]), **load_file(files[1])}
    assert _same({k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in got.items()},
                 {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in want.items()})
    cast = read_weights(files, "cpu", torch.bfloat16)  # floats converted, integers and bools kept
    assert cast["a.f32"].dtype == torch.bfloat16 and torch.equal(cast["a.f32"], want["a.f32"].bfloat16())
    assert cast["b.i64"].dtype == torch.int64 and torch.equal(cast["b.i64"], want["b.i64"])
    assert cast["b.bool"].dtype == torch.bool


def test_weight_files_of_a_folder_without_safetensors_is_none(tmp_path):
    assert weight_files(tmp_path) is None


@pytest.mark.parametrize("damage", ["truncated", "header", "short"])
def test_damaged_weight_file_is_one_siftError(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, path)
    data = path.read_bytes()
    if damage == "truncated":  # the header promises bytes the file does not have
        path.write_bytes(data[:-100])
    elif damage == "header":
        path.write_bytes(data[:8] + b"{not json" + data[17:])
    else:
        path.write_bytes(data[:5])
    with pytest.raises(SiftError, match=r"model\.safetensors .*restore it from the model's source") as e:
        read_weights([path], "cpu")
    assert "\n" not in str(e.value)


def test_a_class_keeping_modules_in_fp32_gets_the_checkpoints_floats(monkeypatch):
    """Where the model class keeps some modules in fp32, the weights are handed over in the checkpoint's dtype for
    transformers to convert: the same model as transformers' own loader gives (reference), fp32 norms included."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["norm"])  # (in bf16 too)
    ref = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.bfloat16, attn_implementation="sdpa")
    model, _, _ = load_model(DEFAULT_MODEL, dtype="bfloat16", identity=False)
    assert model.model.norm.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    assert _same(dict(ref.named_parameters()), dict(model.named_parameters()))
