"""LoRA through the trainer on 1 rank: ``train.init_from`` a HF directory (the base) with adapters on
the foundation, the base weights stay exactly the HF ones while the adapters learn, the checkpoint's
optimizer state holds only the adapters (and the unfrozen projector), and a run resumed from its
step-2 checkpoint continues with the same losses and weights; a run given its adapters by dotted
keys (``model.foundation.lora.r=8``) with the vision side in full exports an adapter peft loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.train_factory import final_state, losses, max_abs_diff, read_metrics, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_intra_op_thread")]  # end to end: training runs

LORA = {"+model.foundation.lora": "{r: 4, alpha: 8, targets: all-linear}", "model.image_encoder.freeze": "true"}




@pytest.fixture(scope="module")
def base_hf(tmp_path_factory):
    """The demo model, seeded, exported as a HF directory (what ``train.init_from`` starts from)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import export_hf
    from omniweave.models.registry import build_model

    recipe = load_recipe("demo", [])
    model_cfg = to_dict(recipe.model)
    torch.manual_seed(5)
    model = build_model(model_cfg)
    model.init_weights()
    return export_hf(model, model_cfg, tmp_path_factory.mktemp("base") / "hf", data_cfg=to_dict(recipe.data))


@pytest.fixture(scope="module")
def lora_run(demo_packed, base_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    train_in_process(demo_packed, out, steps=4, train__save_interval=2, train__keep_last=0, train__init_from=base_hf, **LORA)
    return out


def test_init_from_hf_trains_only_the_adapters(lora_run, base_hf):
    from omniweave.models.hf.loading import load_hf
    from omniweave.models.lora import is_adapter_name

    base, _ = load_hf(base_hf)
    trained = final_state(lora_run)
    base_sd = base.state_dict()
    frozen = {k for k in trained if not is_adapter_name(k) and not k.startswith("projector.")}
    assert frozen == {k for k in base_sd if not k.startswith("projector.")}
    assert all(torch.equal(trained[k], base_sd[k]) for k in frozen)  # the HF base, untouched
    b = [k for k in trained if k.endswith("lora_B.weight")]
    assert b and all(float(trained[k].abs().max()) > 0 for k in b)  # B left zero: the adapters learnt
    assert any(not torch.equal(trained[k], base_sd[k]) for k in trained if k.startswith("projector."))
    assert all(r["loss"] == r["loss"] for r in read_metrics(lora_run))


def test_optimizer_state_holds_only_the_trainable_parameters(lora_run):
    import torch.distributed.checkpoint as dcp

    from omniweave.models.lora import is_adapter_name

    meta = dcp.FileSystemReader(str(lora_run / "checkpoints/latest")).read_metadata().state_dict_metadata
    moments = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in meta if k.startswith("optim.state.")}
    assert moments and all(is_adapter_name(k) or k.startswith("projector.") for k in moments), sorted(moments)[:5]
    assert any(is_adapter_name(k) for k in moments)


def test_resumed_lora_run_matches_the_uninterrupted_one(lora_run, demo_packed, base_hf, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(lora_run / "checkpoints/step_000002", run / "checkpoints/step_000002")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(lora_run)[:2]))
    train_in_process(demo_packed, run, resume="auto", steps=4, train__save_interval=2, train__keep_last=0, train__init_from=base_hf, **LORA)
    assert losses(run) == pytest.approx(losses(lora_run), rel=1e-6)
    assert max_abs_diff(final_state(run), final_state(lora_run)) <= 1e-6


def test_trained_adapter_exports_over_its_init_from_base(lora_run, base_hf, tmp_path, capsys):
    """``hf export RUN --adapter`` of the run above: no base/ (the run started from ``base_hf``), the
    trained projector rides as PEFT modules_to_save, and ``hf verify BASE --adapter`` (peft's
    PeftModel over the base vs omniweave) passes."""
    pytest.importorskip("peft")
    from omniweave.cli import main as cli

    assert cli(["hf", "export", str(lora_run), "--output", str(tmp_path / "out"), "--adapter"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter"]
    config = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.visual.merger"] and config["r"] == 4
    assert config["base_model_name_or_path"] == str(base_hf.resolve())
    capsys.readouterr()
    assert cli(["hf", "verify", str(base_hf), "--adapter", str(tmp_path / "out/adapter")]) == 0
    print(capsys.readouterr().out)


def test_dotted_lora_keys_train_and_export_with_the_vision_side_in_full(demo_packed, base_hf, tmp_path, capsys):
    """The case users hit first: the demo recipe with ``model.foundation.lora.r=8
    model.foundation.lora.alpha=16`` (the dotted form) and its vision tower and projector training
    in full. The adapter keeps them as one module, ``model.visual`` (the merger inside it is not
    listed again), and ``hf verify BASE --adapter`` (peft over the untouched base) passes."""
    pytest.importorskip("peft")
    from omniweave.cli import main as cli

    run = tmp_path / "run"
    train_in_process(demo_packed, run, steps=2, train__init_from=base_hf,
                     **{"model.foundation.lora.r": 8, "model.foundation.lora.alpha": 16})
    assert cli(["hf", "export", str(run), "--output", str(tmp_path / "out"), "--adapter"]) == 0
    config = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (8, 16, ["model.visual"])
    capsys.readouterr()
    assert cli(["hf", "verify", str(base_hf), "--adapter", str(tmp_path / "out/adapter")]) == 0
    assert "OK: all differences within atol" in capsys.readouterr().out
