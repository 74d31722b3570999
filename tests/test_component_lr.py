"""Per-component optimisation (``model.<component>.lr`` / ``lr_scale`` / ``weight_decay``,
train/optim.py): each component's parameters in groups of their own, with their own rate and
decay, under the schedule, logged per group, resumed, LoRA adapters in their component's group,
bad values refused in one line before any rank starts."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from omniweave.cli import main as cli
from omniweave.errors import UserError
from omniweave.train.schedule import lr_factor
from tests.train_factory import final_state, overrides, read_metrics, recipe, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]

# a large rate for the one-step ratio tests: the update then dwarfs fp32's rounding of theta + delta
# (half an ulp of a norm weight near 1 is 6e-8, 2e-4 of a step of 3e-4 at the demo's 3e-3)
STEP_LR = 0.05


def _initial(cfg) -> dict[str, torch.Tensor]:
    """The trainer's initial weights of ``cfg`` (its seed, before any step)."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(int(cfg.train.seed))
    init = build_model(to_dict(cfg.model))
    init.init_weights()
    return {k: v.detach().clone() for k, v in init.state_dict().items()}


def _moved(final, init, prefix) -> float:
    return max(float((final[k] - init[k]).abs().max()) for k in final if k.startswith(prefix))


def _first_step(packed, out, **extra) -> tuple[dict, dict]:
    """(initial, after one step) weights of a one-step run at :data:`STEP_LR`, weight decay 0.1."""
    from omniweave.train.trainer import train

    cfg = recipe(packed, out, steps=1, train__warmup=0, train__lr=STEP_LR, train__weight_decay=0.1, **extra)
    init = _initial(cfg)
    train(cfg)
    return init, final_state(out)


@pytest.fixture(scope="module")
def plain_step(demo_packed, tmp_path_factory):
    return _first_step(demo_packed, tmp_path_factory.mktemp("plain_step") / "run")


def test_a_tower_with_lr_0_keeps_its_weights_bit_identical_while_the_llm_trains(demo_packed, tmp_path):
    from omniweave.train.trainer import train

    cfg = recipe(demo_packed, tmp_path / "run", steps=3, train__weight_decay=0.1, model__image_encoder__lr=0)
    init = _initial(cfg)
    train(cfg)
    final = final_state(tmp_path / "run")
    assert len([k for k in final if k.startswith("image_encoder.")]) > 10
    assert _moved(final, init, "image_encoder.") == 0.0  # weight decay too: AdamW's decay is lr-scaled
    assert _moved(final, init, "foundation.") > 1e-4 and _moved(final, init, "projector.") > 1e-4
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3
    assert all(r["lr/image_encoder"] == 0.0 for r in rows) and rows[0]["lr/foundation"] == rows[0]["lr"] > 0


def test_lr_scale_0_1_gives_a_tenth_of_the_update(demo_packed, tmp_path, plain_step):
    """AdamW's update is lr · (m̂ / (√v̂ + ε) + wd · θ): the first step of the same gradients at a
    tenth of the rate moves each tower tensor by a tenth (Σ|Δθ| per tensor, within 1e-5 relative:
    fp32's rounding of θ + Δθ), and every other tensor exactly as without lr_scale."""
    init, base = plain_step
    init_s, scaled = _first_step(demo_packed, tmp_path / "scaled", model__image_encoder__lr_scale=0.1)
    assert all(torch.equal(init[k], init_s[k]) for k in init)
    ratios = {}
    for k in base:
        if k.startswith("image_encoder."):
            moved = (base[k].double() - init[k].double()).abs().sum()
            ratios[k] = float((scaled[k].double() - init[k].double()).abs().sum() / moved)
        else:  # the rest of the model took the same step
            assert torch.equal(scaled[k], base[k]), k
    worst = max(abs(r / 0.1 - 1) for r in ratios.values())
    print(f"update ratio over {len(ratios)} tower tensors: worst relative error from 0.1 {worst:.1e}")
    assert len(ratios) > 10 and worst <= 1e-5


def test_a_components_weight_decay_reaches_its_update(demo_packed, tmp_path, plain_step):
    """``model.image_encoder.weight_decay=0.6`` (train.weight_decay 0.1): AdamW first decays θ by
    lr · wd · θ, so the tower's decayed tensors end lr · 0.5 · θ₀ below the plain run's; its norms
    and biases, which never decay, and the rest of the model are bit-identical."""
    init, base = plain_step
    _, decayed = _first_step(demo_packed, tmp_path / "decayed", model__image_encoder__weight_decay=0.6)
    fits = []
    for k in base:
        if k.startswith("image_encoder.") and base[k].ndim >= 2:
            theta, extra = init[k].double(), (base[k].double() - decayed[k].double())
            fits.append(float((extra * theta).sum() / (theta * theta).sum()))  # least squares: extra = c · θ₀
        else:
            assert torch.equal(decayed[k], base[k]), k
    assert len(fits) > 5
    assert all(c == pytest.approx(STEP_LR * 0.5, rel=1e-3) for c in fits), fits


def test_groups_carry_each_components_rate_and_decay():
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.train.optim import build_optimizer

    cfg = load_recipe("demo", ["train.lr=2e-3", "train.weight_decay=0.01", "model.image_encoder.lr=1e-4",
                               "model.projector.lr_scale=0.5", "model.foundation.weight_decay=0.2"])
    model = build_model(to_dict(cfg.model))
    opt = build_optimizer(model, cfg)
    got = {(g["component"], g["weight_decay"] > 0): (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert got == {("foundation", True): (2e-3, 0.2), ("foundation", False): (2e-3, 0.0),
                   ("image_encoder", True): (1e-4, 0.01), ("image_encoder", False): (1e-4, 0.0),
                   ("projector", True): (1e-3, 0.01), ("projector", False): (1e-3, 0.0)}
    held = {id(p): g["component"] for g in opt.param_groups for p in g["params"]}
    assert held == {id(p): n.split(".")[0] for n, p in model.named_parameters()}  # each parameter once
    plain = build_optimizer(build_model(to_dict(load_recipe("demo").model)), load_recipe("demo"))
    assert [g["weight_decay"] for g in plain.param_groups] == [0.01, 0.0]  # the demo's decay / no-decay, as before
    assert all("component" not in g for g in plain.param_groups)


def test_lora_adapters_are_in_their_components_group(demo_packed, tmp_path):
    """``model.foundation.lora`` with ``lr_scale=2``: the foundation's groups hold exactly its
    adapters (its base weights are frozen), at twice train.lr; the tower keeps train.lr."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.lora import is_adapter_name
    from omniweave.models.registry import build_model
    from omniweave.train.optim import build_optimizer

    lora = {"model__foundation__lora": "{r: 4, alpha: 8, targets: all-linear}", "model__foundation__lr_scale": 2}
    cfg = load_recipe("demo", overrides(demo_packed, tmp_path / "run", steps=1, train__lr=1e-3, **lora))
    model = build_model(to_dict(cfg.model))
    opt = build_optimizer(model, cfg)
    adapters = {id(p) for n, p in model.named_parameters() if is_adapter_name(n)}
    mine = {id(p) for g in opt.param_groups if g["component"] == "foundation" for p in g["params"]}
    assert len(adapters) > 10 and mine == adapters
    assert {g["component"]: g["lr"] for g in opt.param_groups} == {"foundation": 2e-3, "image_encoder": 1e-3,
                                                                   "projector": 1e-3}
    train_in_process(demo_packed, tmp_path / "run", steps=1, train__lr=1e-3, train__warmup=0, **lora)
    row = read_metrics(tmp_path / "run")[0]
    assert row["lr/foundation"] == row["lr"] == 2e-3 and row["lr/image_encoder"] == 1e-3


@pytest.mark.parametrize("override, message", [
    (["model.image_encoder.lr=1e-4", "model.image_encoder.lr_scale=0.1"],
     "model.image_encoder.lr and model.image_encoder.lr_scale both set"),
    (["model.projector.lr=-1"], "model.projector.lr=-1: a number >= 0"),
    (["model.image_encoder.lr_scale=-0.5"], "model.image_encoder.lr_scale=-0.5: a number >= 0"),
    (["model.foundation.weight_decay=-0.1"], "model.foundation.weight_decay=-0.1: a number >= 0"),
    (["model.foundation.lr=fast"], "model.foundation.lr='fast': a number >= 0"),
])
def test_bad_settings_are_one_line_before_any_rank_starts(demo_packed, tmp_path, capsys, override, message):
    """Checked by the CLI before it launches (``--nproc 2`` would start torchrun)."""
    from omniweave.config import load_recipe
    from omniweave.train.trainer import check_ready

    ov = overrides(demo_packed, tmp_path / "run", steps=1)
    with pytest.raises(UserError, match=message):
        check_ready(load_recipe("demo", [*ov, *override]), None)
    assert cli(["train", "demo", *ov, *override, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_continues_every_groups_rate_bit_identically(demo_packed, tmp_path):
    """The run as it was at step 2 (its checkpoint), resumed: each group's rate follows the cosine
    schedule from its own base rate, and weights, losses and rates equal the uninterrupted run's."""
    kw = {"steps": 4, "train__save_interval": 2, "train__keep_last": 0, "train__lr": 1e-3,
          "model__image_encoder__lr_scale": 0.25, "model__projector__lr": 5e-4, "model__foundation__weight_decay": 0.05}
    train_in_process(demo_packed, tmp_path / "whole", **kw)
    step2 = "checkpoints/step_000002"
    shutil.copytree(tmp_path / "whole" / step2, tmp_path / "cut" / step2)
    train_in_process(demo_packed, tmp_path / "cut", resume="auto", **kw)
    whole, cut = final_state(tmp_path / "whole"), final_state(tmp_path / "cut")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = read_metrics(tmp_path / "whole")
    keys = ("step", "loss", "grad_norm", "lr", "lr/foundation", "lr/image_encoder", "lr/projector")
    assert [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "cut")] == [{k: r[k] for k in keys}
                                                                                  for r in rows[2:]]
    tc = yaml.safe_load((tmp_path / "cut" / "config.yaml").read_text())["train"]
    for r in rows:  # metrics' lr is the rate the step used: step s is optimizer step s - 1
        factor = lr_factor(r["step"] - 1, 4, tc["warmup"], tc["schedule"], tc["min_lr_ratio"])
        assert (r["lr/foundation"], r["lr/image_encoder"], r["lr/projector"]) == pytest.approx(
            (1e-3 * factor, 0.25e-3 * factor, 5e-4 * factor), rel=1e-12)


def test_a_resume_may_add_a_components_rate(demo_packed, tmp_path, capsys):
    """A run saved without per-component groups, resumed with ``model.image_encoder.lr_scale``: the
    resume says it applies the key, the tower trains at half the rate from then on."""
    run = tmp_path / "run"
    train_in_process(demo_packed, run, steps=2, train__save_interval=2, train__keep_last=0, train__lr=1e-3)
    capsys.readouterr()
    train_in_process(demo_packed, run, steps=3, train__save_interval=2, train__keep_last=0, train__lr=1e-3,
                     resume="auto", model__image_encoder__lr_scale=0.5)
    assert "model.image_encoder.lr_scale (None -> 0.5)" in capsys.readouterr().out
    last = read_metrics(run)[-1]
    assert last["step"] == 3 and "lr/image_encoder" not in read_metrics(run)[0]
    assert last["lr/image_encoder"] == pytest.approx(0.5 * last["lr/foundation"], rel=1e-12) and last["lr"] > 0
