"""The default drafter lookup used when no --model and no drafter are given."""

from __future__ import annotations

from blockspec.loader.default_model import DIR_NAME, default_drafter_dir


def test_default_drafter_dir(tmp_path):
    assert default_drafter_dir(tmp_path) is None
    d = tmp_path / DIR_NAME
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert default_drafter_dir(tmp_path) is None  # weights missing
    (d / "model.safetensors").write_bytes(b"")
    assert default_drafter_dir(tmp_path) == d
