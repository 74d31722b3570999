"""Qwen3.5 and Qwen3.5-MoE with vision as OmniModel (qwen3_vit without DeepStack + qwen3_merger +
the hybrid decoder: Gated DeltaNet and gated attention layers, interleaved M-RoPE over a partial
rotary, a gated shared expert) against transformers 5.24's ``Qwen3_5(Moe)ForConditionalGeneration``
on tiny random models (fp32): logits, gradients and positions with images and a video, packed
documents against each alone, export round trip, ``hf verify``, and the multi-token-prediction
tensors of a released checkpoint skipped with a log line."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from omniweave.models.hf.export import export_hf, hf_model_type
from omniweave.models.hf.loading import adapter_for, load_hf
from qwen3_vl_factory import (HYBRID_FAMILIES, MEDIA_CASES, hf_class, hf_inputs, hf_position_ids, make_sample, ours_batch,
                              pack, save_tiny)  # fmt: skip

TOL = 1e-4


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    path, _ = save_tiny(family, tmp_path_factory.mktemp(family) / "hf")
    hf = hf_class(family).from_pretrained(path, attn_implementation="eager").eval()
    ours, cfg = load_hf(path)
    return family, hf, ours.eval(), cfg, path


@pytest.mark.parametrize("case", ["text_only", "images", "video", "mixed"])
def test_logits_grads_and_positions_match_transformers(pair, case):
    family, hf, ours, _, _ = pair
    sample = make_sample(MEDIA_CASES[case], seed=3)
    assert torch.equal(sample["position_ids"], hf_position_ids(hf, sample))  # our pack-time positions
    hf.zero_grad(), ours.zero_grad()
    ref = hf(**hf_inputs(sample)).logits[0]
    got = ours.logits(ours_batch(sample))
    assert got.shape == ref.shape and (got - ref).abs().max().item() <= TOL
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    adapter = adapter_for(family)
    hf_grads = {adapter.name_to_ours(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}
    checked = set()
    for name, p in ours.named_parameters():
        g_ref = hf_grads.get(name)
        if g_ref is None or g_ref.norm() == 0:
            continue
        rel = (p.grad - g_ref).norm() / g_ref.norm()
        # the decay's A_log / dt_bias: fp32 cancellation over tokens (tests/test_qwen3_5_decoder.py)
        assert rel <= (5e-4 if name.endswith(("A_log", "dt_bias")) else TOL), f"{name}: relative gradient error {rel:.2e}"
        checked.add(name)
    assert {"foundation.layers.0.linear_attn.in_proj_qkv.weight", "foundation.layers.1.self_attn.q_proj.weight"} <= checked
    assert ("image_encoder.pos_embed.weight" in checked) == bool(sample["kinds"])
    if family == "qwen3_5_moe":
        assert {"foundation.layers.0.mlp.experts.gate_up_proj", "foundation.layers.2.mlp.shared_expert_gate.weight"} <= checked


def test_packed_documents_equal_each_alone_in_transformers(pair):
    """The linear layers' state and convolution window restart at every document of the row."""
    _, hf, ours, _, _ = pair
    docs = [make_sample(MEDIA_CASES[c], seed=i) for i, c in enumerate(("mixed", "text_only", "video", "images"))]
    with torch.no_grad():
        ref = torch.cat([hf(**hf_inputs(d)).logits[0] for d in docs])
        got = ours.logits(pack(docs))
    assert (got - ref).abs().max().item() <= TOL


def test_export_round_trip_loads_in_transformers(pair, tmp_path):
    family, hf, ours, _, _ = pair
    assert hf_model_type(ours) == family
    out = export_hf(ours, None, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family and "deepstack_visual_indexes" not in cfg["vision_config"]
    assert cfg["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.5
    back = hf_class(family).from_pretrained(out, attn_implementation="eager").eval()
    sample = make_sample(MEDIA_CASES["mixed"], seed=4)
    with torch.no_grad():
        # equal up to the MoE's unordered fp32 index_add across threads
        torch.testing.assert_close(back(**hf_inputs(sample)).logits, hf(**hf_inputs(sample)).logits, atol=1e-6, rtol=0)
    again, _ = load_hf(out)
    with torch.no_grad():
        torch.testing.assert_close(again.logits(ours_batch(sample)), ours.logits(ours_batch(sample)), atol=1e-6, rtol=0)


def test_hf_verify_passes_with_an_image_and_a_video(pair, capsys):
    from omniweave.cli import main

    _, _, _, _, path = pair
    assert main(["hf", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "position_ids" in out and "logits" in out and "OK" in out


def test_multi_token_prediction_tensors_are_skipped_with_a_log_line(pair, tmp_path, caplog):
    """Released Qwen3.5 checkpoints carry ``mtp.*`` layers that transformers drops: ours too, said once."""
    from safetensors.torch import load_file, save_file

    family, _, ours, _, path = pair
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({"mtp.fc.weight": torch.zeros(56, 112), "mtp.layers.0.input_layernorm.weight": torch.zeros(56)})
    (tmp_path / "src").mkdir()
    save_file(tensors, str(tmp_path / "src/model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "src/config.json").write_text((path / "config.json").read_text())
    with caplog.at_level(logging.WARNING, logger="omniweave.hf"):
        loaded, _ = load_hf(tmp_path / "src")
    assert f"{family}: 2 checkpoint tensor(s) not loaded (mtp.*" in caplog.text
    batch = ours_batch(make_sample(MEDIA_CASES["images"], seed=5))
    with torch.no_grad():
        # the same weights: equal up to the order of the MoE's fp32 index_add (not ordered across threads)
        torch.testing.assert_close(loaded.logits(batch), ours.logits(batch), atol=1e-6, rtol=0)


def test_cli_export_with_the_recipe_names_the_qwen3_vl_processors_and_verifies(pair, tmp_path, capsys):
    """``omniweave hf export`` of a checkpoint dir holding the tiny recipe: the processor configs
    name Qwen3VLProcessor (transformers' processor for qwen3_5), and ``hf verify`` on the export
    compares images and videos through transformers' own processors."""
    import yaml

    from omniweave.cli import main
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import save_checkpoint_dir

    family, _, ours, cfg, _ = pair
    ckpt = save_checkpoint_dir(ours, cfg, tmp_path / "ckpt")
    data = to_dict(load_recipe(f"tiny_{family}").data)  # the recipe's tokenizer, template and vision
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"model": cfg, "data": data}, sort_keys=False))
    assert main(["hf", "export", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    proc = json.loads((tmp_path / "hf/processor_config.json").read_text())
    assert proc["processor_class"] == "Qwen3VLProcessor"
    assert json.loads((tmp_path / "hf/video_preprocessor_config.json").read_text())["video_processor_type"] == \
        "Qwen3VLVideoProcessor"
    capsys.readouterr()
    assert main(["hf", "verify", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    for what in ("input_ids", "pixel_values", "position_ids", "logits", "OK"):
        assert what in out
