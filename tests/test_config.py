"""Recipe composition: defaults lists resolve component groups; key=value overrides apply."""

import textwrap

import pytest

from omniweave import config


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_recipe_composes_components_and_overrides(tmp_path, monkeypatch):
    _write(tmp_path / "models/foundation/tiny.yaml", "hidden: 8\nlayers: 2\n")
    _write(
        tmp_path / "recipes/r.yaml",
        """\
        defaults:
          - foundation@model.foundation: tiny
          - _self_
        train:
          steps: 3
        """,
    )
    monkeypatch.setattr(config, "CONFIGS_DIR", tmp_path)
    cfg = config.load_recipe("r", ["train.steps=5", "model.foundation.layers=4"])
    assert config.to_dict(cfg) == {"model": {"foundation": {"hidden": 8, "layers": 4}}, "train": {"steps": 5}}


def test_missing_recipe_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CONFIGS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        config.load_recipe("nope")
