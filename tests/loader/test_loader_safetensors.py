"""Streaming safetensors checkpoints: single file, sharded with an index, and every broken variant."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.loader import safetensors_loader
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.safetensors_loader import INDEX_FILE, iter_safetensors
from blockspec.loader.safetensors_writer import write_safetensors


def shard(src: Path, out: Path, parts: int = 2) -> dict[str, torch.Tensor]:
    """Re-save ``src``'s model.safetensors as ``parts`` shards plus the HF index; return the tensors."""
    state = load_file(src / "model.safetensors")
    out.mkdir()
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({n: state[n] for n in chunk}, out / file)
        weight_map.update(dict.fromkeys(chunk, file))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((src / "config.json").read_text())
    return state


def test_single_file(tiny_models):
    expected = load_file(tiny_models["llama"] / "model.safetensors")
    got = dict(iter_safetensors(tiny_models["llama"], "cpu"))
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_sharded_with_index(tiny_models, tmp_path):
    expected = shard(tiny_models["llama"], tmp_path / "sharded", parts=3)
    got = dict(iter_safetensors(tmp_path / "sharded", torch.device("cpu")))
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_tensors_arrive_one_by_one(tiny_models, tmp_path):
    """A generator, not a dict: nothing past the first tensor is read before it is consumed."""
    shard(tiny_models["llama"], tmp_path / "sharded")
    stream = iter_safetensors(tmp_path / "sharded", "cpu")
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
    stream.close()


def test_skip_never_reads(tiny_models, monkeypatch):
    read: list[str] = []
    real_open = safetensors_loader.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(safetensors_loader, "safe_open", Spy)
    got = dict(iter_safetensors(tiny_models["llama"], "cpu", skip=lambda n: ".mlp." in n))
    assert got and not any(".mlp." in n for n in got)
    assert read == list(got)


def test_missing_shard(tiny_models, tmp_path):
    shard(tiny_models["llama"], tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing shard\(s\) model-00002-of-00002.safetensors: .*fetch them"):
        next(iter_safetensors(tmp_path / "sharded", "cpu"))


def test_index_names_a_tensor_the_shard_lacks(tiny_models, tmp_path):
    shard(tiny_models["llama"], tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "sharded" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="shard lacks it"):
        list(iter_safetensors(tmp_path / "sharded", "cpu"))


def test_corrupt_index(tiny_models, tmp_path):
    shard(tiny_models["llama"], tmp_path / "sharded")
    (tmp_path / "sharded" / INDEX_FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*index"):
        list(iter_safetensors(tmp_path / "sharded", "cpu"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file(tiny_models, tmp_path, damage):
    data = (tiny_models["llama"] / "model.safetensors").read_bytes()
    broken = {"garbage": b"\x00\x01garbage" * 50, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    (tmp_path / "model.safetensors").write_bytes(broken)
    with pytest.raises(ModelLoadError, match="corrupt or truncated, re-download"):
        list(iter_safetensors(tmp_path, "cpu"))


def test_missing_directory_or_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        list(iter_safetensors(tmp_path / "nope", "cpu"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no model.safetensors .*convert them to safetensors"):
        list(iter_safetensors(tmp_path, "cpu"))


def test_streaming_writer_round_trip(tmp_path):
    tensors = {"b": torch.randn(3, 5), "a.weight": torch.randn(7), "c": torch.randn(2, 2, 2)}
    specs = [(n, tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "model.safetensors"
    write_safetensors(path, specs, torch.bfloat16, ((n, t.bfloat16()) for n, t in tensors.items()))
    got = load_file(path)
    assert set(got) == set(tensors)
    assert all(torch.equal(got[n], t.bfloat16()) for n, t in tensors.items())


def test_streaming_writer_rejects_a_stream_that_differs_from_the_plan(tmp_path):
    specs = [("a", (2,)), ("b", (3,))]
    with pytest.raises(ModelLoadError, match="does not match the planned layout"):
        write_safetensors(
            tmp_path / "x.safetensors", specs, torch.float32, [("a", torch.zeros(2)), ("b", torch.zeros(4))]
        )
    with pytest.raises(ModelLoadError, match="ended early"):
        write_safetensors(tmp_path / "y.safetensors", specs, torch.float32, [("a", torch.zeros(2))])
