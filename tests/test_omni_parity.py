"""OmniModel vs transformers' Qwen2-VL / Qwen2.5-VL on tiny random models (fp32): logits,
parameter gradients, loss; scatter errors; no-media batches; KV-cache generation (TorchRollout); export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import adapter_for, load_hf
from vl_factory import MEDIA_CASES, check_logits_and_grads, hf_class, hf_inputs, hf_position_ids, make_sample, save_tiny

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    family = request.param
    path = save_tiny(family, tmp_path_factory.mktemp(family) / "hf")
    hf = hf_class(family).from_pretrained(path, attn_implementation="eager").eval()
    ours, _ = load_hf(path)
    return family, path, hf, ours.eval()


def _batch(hf, sample):
    batch = {k: v for k, v in sample.items() if k != "kinds"}
    batch["position_ids"] = hf_position_ids(hf, sample)
    return batch


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_logits_and_grads_match_transformers(pair, case):
    family, _, hf, ours = pair
    sample = make_sample(MEDIA_CASES[case], seed=3)
    adapter = adapter_for(family)
    grads_as_ours = lambda hf: {adapter.name_to_ours(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}  # noqa: E731
    checked = check_logits_and_grads(hf, ours, hf_inputs(sample), _batch(hf, sample), grads_as_ours, require_all=False)
    vision_grads = [n for n in checked if n.startswith("image_encoder")]
    assert len(checked) > 20 and (bool(vision_grads) == bool(sample["kinds"]))


def test_loss_sum_equals_cross_entropy_of_hf_logits(pair):
    _, _, hf, ours = pair
    sample = make_sample(MEDIA_CASES["mixed"], seed=4)
    batch = _batch(hf, sample)
    with torch.no_grad():
        logits = hf(**hf_inputs(sample)).logits[0]
        out = ours(batch)
    want = F.cross_entropy(logits, sample["labels"], ignore_index=-100, reduction="sum")
    assert int(out.num_tokens) == int((sample["labels"] != -100).sum())
    assert abs(out.loss_sum.item() - want.item()) <= 1e-3 * max(1.0, want.item())


def test_vision_tower_alone_matches_hf_visual(pair):
    _, _, hf, ours = pair
    sample = make_sample(MEDIA_CASES["mixed"], seed=5)
    with torch.no_grad():
        ref = hf.model.visual(sample["pixel_values"], grid_thw=sample["grid_thw"]).pooler_output
        got = ours.encode_media(sample["pixel_values"], sample["grid_thw"])
    assert (got - ref).abs().max().item() <= 1e-5


def test_span_count_mismatch_is_a_clear_error(pair):
    _, _, hf, ours = pair
    sample = make_sample(MEDIA_CASES["one_image"], seed=6)
    batch = _batch(hf, sample)
    batch["media_spans"] = batch["media_spans"].clone()
    batch["media_spans"][0, 1] -= 1
    with pytest.raises(ValueError, match="do not match placeholder spans"):
        ours.logits(batch)


def test_no_media_batch_runs_encoder_with_zero_contribution(pair):
    _, _, hf, ours = pair
    sample = make_sample([], seed=7)
    batch = {k: v for k, v in sample.items() if k != "kinds"}
    batch["grid_thw"] = torch.zeros(0, 3, dtype=torch.long)
    batch["pixel_values"] = torch.zeros(0, 3 * 2 * 14 * 14)
    batch["media_spans"] = torch.zeros(0, 2, dtype=torch.long)
    ours.zero_grad(set_to_none=True)
    out = ours(batch)
    out.loss_sum.backward()
    for module in (ours.image_encoder, ours.projector):
        for name, p in module.named_parameters():
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.count_nonzero(p.grad) == 0, name
    assert ours.foundation.embed_tokens.weight.grad.abs().sum() > 0
    ours.run_encoder_always = False
    try:
        with torch.no_grad():
            assert torch.equal(ours.logits(batch), ours.logits(batch))
            loss_off = ours(batch).loss_sum
        assert abs(loss_off.item() - out.loss_sum.item()) <= 1e-5
    finally:
        ours.run_encoder_always = True


def test_kv_cache_generate_equals_argmax_loop(pair):
    """The generation engine (eval, RL rollouts) against a recompute loop and transformers."""
    from omniweave.generation import Prompt, SamplingParams, TorchRollout

    _, _, hf, ours = pair
    sample = make_sample(MEDIA_CASES["mixed"], seed=8)
    batch = _batch(hf, sample)
    other = _batch(hf, make_sample(MEDIA_CASES["one_image"], seed=5))  # decoded beside it, in the same row
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    got = TorchRollout(ours).generate([Prompt(0, other), Prompt(1, batch)], 1, params, seed=0)[1].tokens
    ids, pos = batch["input_ids"], batch["position_ids"]
    want = []
    with torch.no_grad():
        for _ in range(6):
            b = dict(batch, input_ids=ids, position_ids=pos, cu_seqlens=torch.tensor([0, ids.numel()], dtype=torch.int32))
            b["labels"] = torch.full_like(ids, -100)
            tok = int(ours.logits(b)[-1].argmax())
            want.append(tok)
            ids = torch.cat([ids, torch.tensor([tok])])
            pos = torch.cat([pos, torch.full((3, 1), int(pos.max()) + 1)], dim=1)
    assert got == want
    # and transformers' own greedy generate agrees
    hf_out = hf.generate(**hf_inputs(sample), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf_out[0, sample["input_ids"].numel():].tolist() == want


def test_export_round_trip_loads_in_transformers(pair, tmp_path):
    family, _, hf, ours = pair
    out = export_hf(ours, None, tmp_path / "export")
    again = hf_class(family).from_pretrained(out, attn_implementation="eager").eval()
    sample = make_sample(MEDIA_CASES["mixed"], seed=9)
    with torch.no_grad():
        a = hf(**hf_inputs(sample)).logits
        b = again(**hf_inputs(sample)).logits
    assert torch.equal(a, b)
    reloaded, _ = load_hf(out)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), reloaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_embeddings_load_and_export(tmp_path):
    """Qwen2-VL-2B style (tie_word_embeddings): no lm_head in the checkpoint, none exported."""
    from safetensors import safe_open

    path = save_tiny("qwen2_vl", tmp_path / "hf", tie=True)
    hf = hf_class("qwen2_vl").from_pretrained(path, attn_implementation="eager").eval()
    ours, _ = load_hf(path)
    assert ours.foundation.lm_head.weight is ours.foundation.embed_tokens.weight
    sample = make_sample(MEDIA_CASES["one_image"], seed=10)
    with torch.no_grad():
        assert (ours.logits(_batch(hf, sample)) - hf(**hf_inputs(sample)).logits[0]).abs().max() <= 1e-4
    out = export_hf(ours, None, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "visual.merger.ln_q.bias" in f.keys()
    again = hf_class("qwen2_vl").from_pretrained(out, attn_implementation="eager").eval()
    assert again.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(again(**hf_inputs(sample)).logits, hf(**hf_inputs(sample)).logits)
