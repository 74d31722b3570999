"""Resuming with another recipe: a key that decides what the run learned is refused in one line, a
key that says how to go on is applied and recorded (omniweave/train/resume_keys.py); a checkpoint
of another model (family, parameter names, shapes) is refused before anything loads
(checkpoint.check_fits)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from omniweave.cli import main as cli
from omniweave.errors import UserError
from omniweave.train import checkpoint
from omniweave.train.resume_keys import changed_keys, may_change
from omniweave.train.schedule import lr_factor
from train_factory import REPO, overrides, read_metrics, train_in_process

LR = 1e-3


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def four_steps(demo_packed, tmp_path_factory):
    out = tmp_path_factory.mktemp("keys") / "run"
    train_in_process(demo_packed, out, steps=4, train__lr=LR, train__save_interval=2, train__keep_last=0)
    return out


def test_changed_keys_are_dotted_and_new_schema_keys_are_not_changes():
    saved = {"train": {"lr": 1e-3, "betas": [0.9, 0.95]}, "model": {"foundation": {"tp": 1, "rope_theta": 1e6}}}
    now = {"train": {"lr": 1e-5, "betas": [0.9, 0.95], "added_later": 3}, "model": {"foundation": {"tp": 2, "rope_theta": 1e6}}}
    assert changed_keys(saved, now) == {"model.foundation.tp": (1, 2), "train.lr": (1e-3, 1e-5)}
    assert may_change("train.lr") and may_change("model.foundation.tp") and may_change("parallel.cp")
    assert not may_change("model.foundation.rope_theta") and not may_change("data.max_len")
    assert not may_change("train.global_batch") and not may_change("train.seed")


def test_a_changed_learning_rate_is_applied_and_recorded(four_steps, demo_packed, tmp_path, capsys):
    """The issue's case: lr 1e-3 -> 1e-5 on resume trains at 1e-5 × the schedule, says so, and
    config.yaml and the new checkpoints record it."""
    run = tmp_path / "run"
    shutil.copytree(four_steps, run, symlinks=True)
    train_in_process(demo_packed, run, steps=6, train__lr=1e-5, resume="auto", train__save_interval=2,
                     train__keep_last=0)
    out = capsys.readouterr().out
    assert "resume: applying the recipe's train.lr (0.001 -> 1e-05), train.steps (4 -> 6) from this step on" \
        in out, out[:600]
    logged = {m["step"]: m["lr"] for m in read_metrics(run)}
    tc = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert tc["lr"] == 1e-5 and tc["steps"] == 6
    schedule = {"warmup": tc["warmup"], "schedule": tc["schedule"], "min_lr_ratio": tc["min_lr_ratio"]}
    for step in (5, 6):  # metrics' lr is the rate the step used: step s is optimizer step s - 1
        assert logged[step] == pytest.approx(1e-5 * lr_factor(step - 1, 6, **schedule), rel=1e-12)
    assert logged[4] == pytest.approx(LR * lr_factor(3, 4, **schedule), rel=1e-12)  # the first run's, kept
    final = checkpoint.find_latest(run / "checkpoints")
    assert final.name == "step_000006"
    assert yaml.safe_load((final / "config.yaml").read_text())["train"]["lr"] == 1e-5


@pytest.mark.parametrize("override, says", [
    ("model.foundation.rope_theta=500000.0", "model.foundation.rope_theta (1000000.0 -> 500000.0)"),
    ("train.seed=7", "train.seed (0 -> 7)"),
    ("train.global_batch=2", "train.global_batch (4 -> 2)"),
])
def test_a_key_that_decides_what_was_learned_is_refused(four_steps, demo_packed, tmp_path, override, says, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run, symlinks=True)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    argv = ["train", "demo", *overrides(demo_packed, run, steps=6, train__lr=LR, train__save_interval=2, train__keep_last=0),
            override, "--resume", "auto"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert f"the recipe changes {says}, which a resumed run must keep" in err and "train.init_from=" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# ------------------------------------------------------------------ a checkpoint of another model


def foundation(name: str, **kw) -> dict:
    return {**yaml.safe_load((REPO / f"omniweave/configs/models/foundation/{name}.yaml").read_text()), **kw}


def saved_checkpoint(tmp_path, model_cfg: dict):
    """A one-rank checkpoint of ``build_model(model_cfg)`` with its recipe's model section."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from omniweave.models.registry import build_model

    model = build_model(model_cfg)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return checkpoint.save(tmp_path, 1, model, None, {"step": 1}, OmegaConf.to_yaml({"model": model_cfg}))
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_of_another_family_is_refused_naming_it(tmp_path):
    """A Qwen2.5 checkpoint into a Llama-3 recipe of the same sizes: every shape fits, so without
    the check the q/k/v biases would be dropped silently."""
    ckpt = saved_checkpoint(tmp_path, {"foundation": foundation("qwen2_5_tiny", mrope_section=None)})
    llama = {"foundation": foundation("llama3_tiny")}
    with pytest.raises(UserError) as e:
        checkpoint.load_model(ckpt, llama)
    msg = str(e.value)
    assert "model.foundation.family: checkpoint 'qwen2', recipe 'llama'" in msg
    assert "the checkpoint has, the recipe's model lacks: foundation.layers.0.self_attn.k_proj.bias" in msg
    assert "\n" not in msg


def test_a_moe_checkpoint_into_a_dense_recipe_is_one_line(tmp_path):
    import torch.distributed as dist

    from omniweave.models.registry import build_model

    ckpt = saved_checkpoint(tmp_path, {"foundation": foundation("qwen3_moe_tiny")})
    dense_cfg = {"foundation": foundation("qwen3_tiny")}
    dense = build_model(dense_cfg)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UserError) as e:
            checkpoint.load_weights(ckpt, dense, dense_cfg)
    finally:
        dist.destroy_process_group()
    msg = str(e.value)
    assert "the recipe's model has, the checkpoint lacks: foundation.layers.0.mlp." in msg
    assert "the checkpoint has, the recipe's model lacks: foundation.layers.0.mlp." in msg and "experts" in msg
