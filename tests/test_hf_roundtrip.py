"""HF -> omniweave -> export -> transformers loads it and gives identical logits."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from omniweave.models.hf import export as export_mod
from omniweave.models.hf.export import export_hf, load_checkpoint_dir, save_checkpoint_dir
from omniweave.models.hf.loading import load_hf
from tests.hf_factory import save_tiny


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("llama", False), ("qwen3", False), ("qwen3_moe", False),
                                         ("deepseek_v3", False), ("qwen3_5_text", True), ("qwen3_5_moe_text", False),
                                         ("qwen3_next", False), ("gemma", True)])
def test_export_round_trip_gives_identical_logits(tmp_path, family, tied):
    hf = save_tiny(family, tmp_path / "src", tied)
    ours, cfg = load_hf(tmp_path / "src")
    export_hf(ours, cfg, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, 1024, (1, 23))
    with torch.no_grad():
        # same weights, so equal up to the order of fp32 sums (an MoE's index_add over experts is
        # not ordered on a multi-threaded CPU: two calls of one MoE model differ in the last bits)
        torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.logits({"input_ids": ids[0]}), hf(input_ids=ids).logits[0], atol=1e-4, rtol=0)
    hf_cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert hf_cfg["model_type"] == family and hf_cfg["tie_word_embeddings"] == tied


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_tiny("qwen2", tmp_path / "src", max_shard_size="100KB")
    assert (tmp_path / "src/model.safetensors.index.json").exists()
    ours, _ = load_hf(tmp_path / "src")
    ids = torch.randint(0, 1024, (10,))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits({"input_ids": ids}), hf(input_ids=ids[None]).logits[0], atol=1e-4, rtol=0)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path / "src")
    sd = load_file(tmp_path / "src/model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, tmp_path / "src/model.safetensors")
    with pytest.raises(KeyError, match="foundation.layers.1.mlp.up_proj.weight"):
        load_hf(tmp_path / "src")
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(sd, tmp_path / "src/model.safetensors")
    with pytest.raises(KeyError, match="unexpected tensors.*self_attn.extra.weight"):
        load_hf(tmp_path / "src")


def test_loading_initialises_on_meta_and_allocates_no_random_weights(tmp_path, monkeypatch):
    save_tiny("qwen3", tmp_path / "src")
    calls = []
    orig = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *a, **k: calls.append(tensor.device.type) or orig(tensor, *a, **k))
    ours, _ = load_hf(tmp_path / "src")
    assert set(calls) == {"meta"}
    assert all(p.device.type == "cpu" for p in ours.parameters())


def test_cli_exports_a_checkpoint_dir(tmp_path, capsys):
    import argparse

    save_tiny("qwen2", tmp_path / "src", tied=True)
    ours, cfg = load_hf(tmp_path / "src")
    save_checkpoint_dir(ours, cfg, tmp_path / "ckpt")
    again, _ = load_checkpoint_dir(tmp_path / "ckpt")
    assert again.foundation.lm_head.weight is again.foundation.embed_tokens.weight
    parser = argparse.ArgumentParser()
    export_mod.add_arguments(parser)
    assert export_mod.run(parser.parse_args([str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])) == 0
    assert "exported qwen2 model" in capsys.readouterr().out
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 1024, (9,))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids[None]).logits[0], ours.logits({"input_ids": ids}), atol=1e-4, rtol=0)
