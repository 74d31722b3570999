"""Qwen3-VL and Qwen3-VL-MoE as OmniModel (qwen3_vit + qwen3_merger + Qwen3 / Qwen3-MoE decoder with
interleaved M-RoPE and DeepStack) against transformers' ``Qwen3VL(Moe)ForConditionalGeneration``
on tiny random models (fp32): logits, gradients, positions, packed documents, the vision tower
with its DeepStack features, the no-media pass, the feature_rows path, loading and export."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from omniweave.models.hf.export import export_hf, hf_model_type
from omniweave.models.hf.loading import adapter_for, load_hf
from omniweave.models.omni import feature_rows_from_spans
from qwen3_vl_factory import (FAMILIES, IN_DIM, MEDIA_CASES, hf_class, hf_inputs, hf_position_ids, make_sample,
                              ours_batch, pack, save_tiny)  # fmt: skip

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    path, _ = save_tiny(family, tmp_path_factory.mktemp(family) / "hf")
    hf = hf_class(family).from_pretrained(path, attn_implementation="eager").eval()
    ours, cfg = load_hf(path)
    return family, hf, ours.eval(), cfg


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_logits_grads_and_positions_match_transformers(pair, case):
    family, hf, ours, _ = pair
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
        assert rel <= TOL, f"{name}: relative gradient error {rel:.2e}"
        checked.add(name)
    assert len(checked) > 30
    with_media = bool(sample["kinds"])
    for part in ("image_encoder.pos_embed.weight", "projector.deepstack_merger_list.1.linear_fc2.weight",
                 "image_encoder.patch_embed.proj.bias"):  # fmt: skip
        assert (part in checked) == with_media, part
    if family == "qwen3_vl_moe":
        assert "foundation.layers.0.mlp.experts.gate_up_proj" in checked


def test_packed_documents_equal_each_alone_in_transformers(pair):
    _, hf, ours, _ = pair
    docs = [make_sample(MEDIA_CASES[c], seed=i) for i, c in enumerate(("mixed", "text_only", "video", "images"))]
    with torch.no_grad():
        ref = torch.cat([hf(**hf_inputs(d)).logits[0] for d in docs])
        got = ours.logits(pack(docs))
    assert (got - ref).abs().max().item() <= TOL


def test_vision_tower_and_deepstack_features_match_hf_visual(pair):
    _, hf, ours, _ = pair
    sample = make_sample(MEDIA_CASES["mixed"], seed=5)
    with torch.no_grad():
        ref = hf.model.visual(sample["pixel_values"], grid_thw=sample["grid_thw"])
        got = ours.encode_media(sample["pixel_values"], sample["grid_thw"])  # [N, D·(1+K)]
    want = torch.cat([ref.pooler_output, *ref.deepstack_features], dim=-1)
    assert got.shape == want.shape == (want.shape[0], 56 * 3)
    assert (got - want).abs().max().item() <= 1e-5


def test_deepstack_and_position_table_change_the_logits(pair):
    """Guards against a parity that holds only because a part does nothing."""
    _, _, ours, _ = pair
    batch = ours_batch(make_sample(MEDIA_CASES["images"], seed=6))
    with torch.no_grad():
        base = ours.logits(batch)
        for name in ("projector.deepstack_merger_list.0.linear_fc2.bias", "image_encoder.pos_embed.weight"):
            p = ours.get_parameter(name)
            saved = p.clone()
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
            try:
                assert (ours.logits(batch) - base).abs().max() > 1e-3, name
            finally:
                p.copy_(saved)


def test_feature_rows_path_equals_spans_path(pair):
    """The context-parallel / sequence-parallel hand-off (rows index the media features, DeepStack
    levels placed by the same rows) gives the spans path's logits."""
    _, _, ours, _ = pair
    batch = pack([make_sample(MEDIA_CASES["mixed"], seed=7), make_sample(MEDIA_CASES["video"], seed=8)])
    rows = dict(batch, feature_rows=feature_rows_from_spans(batch["media_spans"], batch["input_ids"].numel()))
    del rows["media_spans"]
    with torch.no_grad():
        assert torch.equal(ours.logits(rows), ours.logits(batch))


def test_no_media_batch_keeps_every_vision_gradient_at_zero(pair):
    _, _, ours, _ = pair
    sample = make_sample([], seed=9)
    batch = dict(ours_batch(sample), grid_thw=torch.zeros(0, 3, dtype=torch.long),
                 pixel_values=torch.zeros(0, IN_DIM), media_spans=torch.zeros(0, 2, dtype=torch.long))  # fmt: skip
    ours.zero_grad(set_to_none=True)
    ours(batch).loss_sum.backward()
    names = []
    for module in (ours.image_encoder, ours.projector):
        for name, p in module.named_parameters():
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
            names.append(name)
    assert any(n.startswith("deepstack_merger_list.") for n in names)


def test_span_sum_mismatch_and_level_mismatch_are_clear_errors(pair):
    _, _, ours, cfg = pair
    batch = ours_batch(make_sample(MEDIA_CASES["video"], seed=10))
    batch["media_spans"] = batch["media_spans"].clone()
    batch["media_spans"][0, 1] -= 1
    with pytest.raises(ValueError, match="do not match placeholder spans"):
        ours.logits(batch)
    from omniweave.models.registry import build_model

    bad = {**cfg, "projector": {**cfg["projector"], "deepstack_levels": 1}}
    with pytest.raises(ValueError, match="deepstack_levels"):
        build_model(bad)


def test_export_round_trip_loads_in_transformers(pair, tmp_path):
    family, hf, ours, _ = pair
    assert hf_model_type(ours) == family
    out = export_hf(ours, None, tmp_path / "export")
    again = hf_class(family).from_pretrained(out, attn_implementation="eager").eval()
    sample = make_sample(MEDIA_CASES["mixed"], seed=11)
    with torch.no_grad():
        assert torch.equal(hf(**hf_inputs(sample)).logits, again(**hf_inputs(sample)).logits)
    reloaded, _ = load_hf(out)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), reloaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    if family == "qwen3_vl_moe":  # released layout on disk: [E, D, 2I] / [E, I, D]
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [5, 56, 72]
            assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [5, 36, 56]


def test_moe_file_in_runtime_layout_is_refused_by_name(tmp_path):
    """transformers' own save_pretrained keeps [E, 2I, D]: with 2I != D the transposing load fails
    naming the tensor instead of guessing the layout from the shape."""
    _, model = save_tiny("qwen3_vl_moe", tmp_path / "released")
    model.save_pretrained(tmp_path / "runtime")
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj"):
        load_hf(tmp_path / "runtime")


def test_cli_export_loads_in_transformers_and_verifies(pair, tmp_path, capsys):
    """``omniweave hf export`` of a plain checkpoint dir, then ``omniweave hf verify`` on the export
    (with an image processor config of patch 16, mean/std 0.5: images through transformers' own)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from omniweave.cli import main
    from omniweave.models.hf.export import save_checkpoint_dir

    family, _, ours, cfg = pair
    ckpt = save_checkpoint_dir(ours, cfg, tmp_path / "ckpt")
    assert main(["hf", "export", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    again = hf_class(family).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    sample = make_sample(MEDIA_CASES["mixed"], seed=12)
    with torch.no_grad():
        assert (again(**hf_inputs(sample)).logits[0] - ours.logits(ours_batch(sample))).abs().max().item() <= TOL
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, min_pixels=32 * 32 * 2,
                             max_pixels=32 * 32 * 64).save_pretrained(tmp_path / "hf")  # fmt: skip
    capsys.readouterr()
    assert main(["hf", "verify", str(tmp_path / "hf")]) == 0  # a random image and a random video
    out = capsys.readouterr().out
    for what in ("input_ids", "pixel_values", "position_ids", "logits", "OK"):
        assert what in out


def test_generation_prefills_with_deepstack_and_matches_transformers(pair):
    """TorchRollout (eval, RL) prefills through foundation_inputs, DeepStack included: greedy
    tokens equal a recompute loop over OmniModel.logits and transformers' own generate."""
    from omniweave.generation import Prompt, SamplingParams, TorchRollout

    _, hf, ours, _ = pair
    sample = make_sample(MEDIA_CASES["mixed"], seed=13)
    batch = ours_batch(sample)
    other = ours_batch(make_sample(MEDIA_CASES["video"], seed=14))  # decoded beside it, in the same row
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    got = TorchRollout(ours).generate([Prompt(0, other), Prompt(1, batch)], 1, params, seed=0)[1].tokens
    ids, pos, want = batch["input_ids"], batch["position_ids"], []
    with torch.no_grad():
        for _ in range(5):
            b = dict(batch, input_ids=ids, position_ids=pos, cu_seqlens=torch.tensor([0, ids.numel()], dtype=torch.int32))
            tok = int(ours.logits(b)[-1].argmax())
            want.append(tok)
            ids = torch.cat([ids, torch.tensor([tok])])
            pos = torch.cat([pos, torch.full((3, 1), int(pos.max()) + 1)], dim=1)
    assert got == want
    hf_out = hf.generate(**hf_inputs(sample), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf_out[0, sample["input_ids"].numel():].tolist() == want


def test_export_processor_files_name_the_qwen3_vl_processors(tmp_path):
    """With the recipe's data section an export names Qwen3VLProcessor / Qwen3VLVideoProcessor and
    carries patch 16 and mean/std 0.5, which transformers' image processor then uses."""
    import json

    from transformers import AutoImageProcessor

    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.processor_files import write_processor_files

    data_cfg = to_dict(load_recipe("tiny_qwen3_vl_moe").data)
    hf_cfg = {"model_type": "qwen3_vl_moe", "vision_config": {"patch_size": 16, "temporal_patch_size": 2,
                                                              "spatial_merge_size": 2}}  # fmt: skip
    write_processor_files(tmp_path, data_cfg, hf_cfg, None)
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    video = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == 16
    image = AutoImageProcessor.from_pretrained(tmp_path)
    assert image.patch_size == 16 and list(image.image_mean) == list(image.image_std) == [0.5] * 3
