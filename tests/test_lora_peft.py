"""LoRA export in PEFT's format (hf/peft_adapter.py) against peft itself, on a tiny random Qwen2-VL:
adapters on the decoder (every Linear) and the vision tower (qkv, fc1), the projector trained in
full (PEFT's modules_to_save). ``hf export --adapter`` -> transformers model of ``DIR/base`` +
``peft.PeftModel.from_pretrained(…, DIR/adapter)`` gives omniweave's logits within 1e-4; the
tensor names and config are the ones peft writes itself for the same adapters; the merged export
equals the adapted model; ``hf verify --adapter`` passes, and refuses an adapter of another base."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch

from omniweave.errors import UserError
from omniweave.models import lora
from omniweave.models.hf import export as export_mod
from omniweave.models.hf.export import save_checkpoint_dir
from omniweave.models.hf.loading import load_hf
from tests.vl_factory import hf_class, hf_inputs, hf_position_ids, make_sample, save_tiny

peft = pytest.importorskip("peft")

LORA = {"foundation": {"r": 4, "alpha": 8, "targets": "all-linear"},
        "image_encoder": {"r": 2, "alpha": 6, "targets": ["qkv", "fc1"]}}
SAMPLE = [("image", (1, 4, 6)), ("video", (2, 4, 4))]
ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(adapted omniweave model, export dir, source HF dir): the checkpoint exported with --adapter."""
    root = tmp_path_factory.mktemp("peft")
    src = save_tiny("qwen2_vl", root / "src")
    model, cfg = load_hf(src)
    cfg = copy.deepcopy(cfg)
    for section, spec in LORA.items():
        cfg[section]["lora"] = spec
    lora.apply_lora(model, cfg)
    torch.manual_seed(7)
    with torch.no_grad():
        for _, m in lora.adapted_linears(model):
            m.lora_B.weight.normal_(std=0.05)
        for p in model.projector.parameters():  # trained in full next to the adapters
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint_dir(model, cfg, root / "ckpt")
    assert _export(root / "ckpt", root / "out", "--adapter") == 0
    return model.eval(), root / "out", src


def _export(ckpt, out, *flags) -> int:
    parser = argparse.ArgumentParser()
    export_mod.add_arguments(parser)
    return export_mod.run(parser.parse_args([str(ckpt), "--output", str(out), *flags]))


def _logits(hf, ours, sample):
    batch = {k: v for k, v in sample.items() if k != "kinds"}
    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    batch["position_ids"] = hf_position_ids(base, sample)
    with torch.no_grad():
        return hf(**hf_inputs(sample)).logits[0], ours.logits(batch)


def test_peft_loads_the_adapter_with_omniweaves_logits(exported):
    ours, out, _ = exported
    base = hf_class("qwen2_vl").from_pretrained(out / "base", attn_implementation="eager").eval()
    with torch.no_grad():
        plain_ref, _ = _logits(base, ours, make_sample(SAMPLE, seed=2))
    model = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ref, got = _logits(model, ours, make_sample(SAMPLE, seed=2))
    diff = float((ref - got).abs().max())
    print(f"PEFT round trip: max |Δlogits| = {diff:.2e}")
    assert diff <= ATOL
    assert float((ref - plain_ref).abs().max()) > 100 * ATOL  # the adapter and projector change the logits


def test_adapter_files_match_what_peft_writes(exported, tmp_path):
    """peft's own save of the same adapters on the transformers model: same tensor names and
    shapes, same LoRA config fields."""
    _, out, _ = exported
    ours_cfg = json.loads((out / "adapter/adapter_config.json").read_text())
    base = hf_class("qwen2_vl").from_pretrained(out / "base")
    config = peft.LoraConfig(r=ours_cfg["r"], lora_alpha=ours_cfg["lora_alpha"], target_modules=ours_cfg["target_modules"],
                             rank_pattern=ours_cfg["rank_pattern"], alpha_pattern=ours_cfg["alpha_pattern"],
                             modules_to_save=ours_cfg["modules_to_save"])
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "peft")
    from safetensors import safe_open

    def shapes(path):
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(out / "adapter/adapter_model.safetensors") == shapes(tmp_path / "peft/adapter_model.safetensors")
    theirs = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert sorted(ours_cfg["target_modules"]) == sorted(theirs["target_modules"])  # peft writes a set's order
    for key in ("peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "modules_to_save",
                "bias", "fan_in_fan_out", "use_rslora", "use_dora", "task_type", "auto_mapping"):
        assert ours_cfg[key] == theirs[key], key
    assert ours_cfg["modules_to_save"] == ["model.visual.merger"]
    assert "model.visual.blocks.0.attn.qkv" in ours_cfg["target_modules"]
    assert ours_cfg["rank_pattern"] == {f"model.visual.blocks.{i}.{m}": 2 for i in range(2) for m in ("attn.qkv", "mlp.fc1")}


def test_merged_export_equals_the_adapter_model(exported, tmp_path):
    ours, out, _ = exported
    assert _export(out.parent / "ckpt", tmp_path / "merged") == 0
    hf = hf_class("qwen2_vl").from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ref, got = _logits(hf, ours, make_sample(SAMPLE, seed=3))
    assert float((ref - got).abs().max()) <= ATOL


def test_verify_adapter_passes_and_refuses_another_base(exported, tmp_path, capsys):
    from omniweave.models.hf import verify

    _, out, _ = exported
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    assert verify.run(parser.parse_args([str(out / "base"), "--adapter", str(out / "adapter")])) == 0
    assert "OK: all differences within atol" in capsys.readouterr().out
    other = save_tiny("qwen2_5_vl", tmp_path / "other")  # another base: its ViT's MLP is gate / up / down
    with pytest.raises(UserError, match=r"exported for another base model.*model.visual.blocks.0.mlp.fc1: "
                                        r"A \[2, 32\], B \[64, 2\] \(no such Linear\)"):
        verify.run(parser.parse_args([str(other), "--adapter", str(out / "adapter")]))


def test_adapter_export_of_a_model_without_adapters_is_refused(tmp_path):
    src = save_tiny("qwen2_vl", tmp_path / "src")
    model, cfg = load_hf(src)
    save_checkpoint_dir(model, cfg, tmp_path / "ckpt")
    with pytest.raises(UserError, match="no LoRA adapters"):
        _export(tmp_path / "ckpt", tmp_path / "out", "--adapter")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_text_model_adapter_over_its_init_from_base(family, tmp_path):
    """A decoder-only model that started from a HF directory (``train.init_from``): no base/ is
    written, the adapter names that directory, and peft over it gives omniweave's logits."""
    from omniweave.models.hf.peft_adapter import export_adapter
    from tests.hf_factory import save_tiny as save_tiny_text

    hf = save_tiny_text(family, tmp_path / "src")
    model, cfg = load_hf(tmp_path / "src")
    cfg = copy.deepcopy(cfg)
    cfg["foundation"]["lora"] = {"r": 3, "alpha": 5, "targets": ["q_proj", "down_proj"]}
    lora.apply_lora(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, m in lora.adapted_linears(model):
            m.lora_B.weight.normal_(std=0.05)
    ids = torch.randint(0, 1024, (17,))
    with torch.no_grad():
        want = model.eval().logits({"input_ids": ids})
    export_adapter(model, cfg, tmp_path / "out", base_dir=str(tmp_path / "src"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter"]
    config = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "src").resolve())
    assert "model.layers.1.mlp.down_proj" in config["target_modules"] and config["lora_alpha"] == 5
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf.eval(), str(tmp_path / "out/adapter")).eval()(input_ids=ids[None]).logits[0]
    assert float((got - want).abs().max()) <= ATOL
