"""Per-component optimisation (``model.<component>.lr`` / ``lr_scale`` / ``weight_decay``,
train/optim.py): each component's parameters in groups of their own, with their own rate and
decay, under the schedule, logged per group, resumed, LoRA adapters in their component's group."""

from __future__ import annotations

import pytest
import torch

from omniweave.errors import UserError
from tests.train_factory import final_state, read_metrics, recipe

pytestmark = [pytest.mark.slow]


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
    assert all(r["lr/image_encoder"] == 0.0 for r in rows) and rows[0]["lr/foundation"] == rows[0]["lr"] > 0


def test_lr_scale_0_1_gives_a_tenth_of_the_update(demo_packed, tmp_path):
    """AdamW's update is lr · m̂ / (√v̂ + ε) (+ lr · wd · θ): one step of the same gradients with a
    tenth of the rate moves every weight by a tenth. Measured as (θ₁ − θ₀) in fp32, whose rounding
    of θ₁ (ulp ~1e-9 at |θ| ~ 0.02) is up to ~1e-4 of an update of 1e-5: the median is 0.1 to 7
    digits, the worst weight within 1.1e-4."""
    from omniweave.train.trainer import train

    runs = {}
    for name, extra in (("base", {}), ("scaled", {"model__image_encoder__lr_scale": 0.1})):
        cfg = recipe(demo_packed, tmp_path / name, steps=1, train__warmup=0, train__weight_decay=0.1, **extra)
        init = _initial(cfg)
        train(cfg)
        final = final_state(tmp_path / name)
        runs[name] = {k: final[k] - init[k] for k in final}
    ratios = []
    for k, base in runs["base"].items():
        scaled = runs["scaled"][k]
        if k.startswith("image_encoder."):
            moved = base.abs() > 1e-6
            ratios.append((scaled[moved] / base[moved]))
        else:  # the rest of the model took the same step
            assert torch.equal(scaled, base), k
    ratio = torch.cat(ratios)
    print(f"update ratio over {ratio.numel()} tower weights: median {ratio.median():.7f}, "
          f"max |ratio - 0.1| {(ratio - 0.1).abs().max():.2e}")
    assert ratio.numel() > 1000 and abs(float(ratio.median()) - 0.1) <= 1e-6
    assert float((ratio - 0.1).abs().max()) <= 5e-4


def test_groups_carry_each_components_rate_and_decay():
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.train.optim import build_optimizer

    cfg = load_recipe("demo", ["train.lr=2e-3", "train.weight_decay=0.01", "model.image_encoder.lr=1e-4",
                               "model.projector.lr_scale=0.5", "model.foundation.weight_decay=0.2"])
    opt = build_optimizer(build_model(to_dict(cfg.model)), cfg)
    got = {(g["component"], g["weight_decay"] > 0): (g["lr"], g["weight_decay"]) for g in opt.param_groups}
    assert got == {("foundation", True): (2e-3, 0.2), ("foundation", False): (2e-3, 0.0),
                   ("image_encoder", True): (1e-4, 0.01), ("image_encoder", False): (1e-4, 0.0),
                   ("projector", True): (1e-3, 0.01), ("projector", False): (1e-3, 0.0)}
    plain = build_optimizer(build_model(to_dict(load_recipe("demo").model)), load_recipe("demo"))
    assert [len(g["params"]) for g in plain.param_groups] and all("component" not in g for g in plain.param_groups)
    assert len(plain.param_groups) == 2  # decay / no-decay, as before per-component groups


def test_lora_adapters_are_in_their_components_group():
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.train.optim import build_optimizer

    cfg = load_recipe("demo", ["train.lr=1e-3", "+model.foundation.lora={r: 4, alpha: 8, targets: all-linear}",
                               "model.image_encoder.freeze=true", "model.projector.freeze=true",
                               "model.foundation.lr_scale=2"])
    opt = build_optimizer(build_model(to_dict(cfg.model)), cfg)
    assert {g["component"] for g in opt.param_groups} == {"foundation"}
    assert all(g["lr"] == pytest.approx(2e-3) for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) > 0


@pytest.mark.parametrize("overrides, message", [
    (["model.image_encoder.lr=1e-4", "model.image_encoder.lr_scale=0.1"], "model.image_encoder.lr and "
                                                                            "model.image_encoder.lr_scale both set"),
    (["model.projector.lr=-1"], r"model.projector.lr=-1: a number >= 0"),
])
def test_bad_settings_are_refused_before_any_rank_starts(demo_packed, tmp_path, overrides, message):
    from omniweave.train.trainer import check_ready

    cfg = recipe(demo_packed, tmp_path, **{o.split("=")[0].replace(".", "__"): o.split("=")[1] for o in overrides})
    with pytest.raises(UserError, match=message):
        check_ready(cfg, None)


def test_resume_continues_every_groups_rate_bit_identically(demo_packed, tmp_path):
    from tests.train_factory import train_in_process

    kw = {"steps": 4, "train__save_interval": 2, "train__keep_last": 0, "train__schedule": "constant",
          "model__image_encoder__lr_scale": 0.25, "model__projector__lr": 5e-4}
    train_in_process(demo_packed, tmp_path / "whole", **kw)
    train_in_process(demo_packed, tmp_path / "cut", **{**kw, "steps": 2})
    train_in_process(demo_packed, tmp_path / "cut", resume="auto", **kw)
    whole, cut = final_state(tmp_path / "whole"), final_state(tmp_path / "cut")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert [r["loss"] for r in read_metrics(tmp_path / "cut")] == [r["loss"] for r in read_metrics(tmp_path / "whole")]
    assert read_metrics(tmp_path / "cut")[-1]["lr/projector"] == 5e-4
