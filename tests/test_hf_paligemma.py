"""PaliGemma (siglip_vit with post_layernorm + the linear projector + a Gemma decoder) against
transformers' PaliGemmaForConditionalGeneration (eager attention, fp32) on a tiny random model whose
sizes are not round: SigLIP width 42 in 3 heads of 14, MLP 50, 2 blocks, 42 px images of 14 px
patches (9 image tokens); Gemma width 48, 3 heads of head_dim 20 (!= 48 / 3), one kv head, MLP 72,
vocab 301, 2 layers, tied embeddings; every weight perturbed so each one matters.

A document is PaliGemmaProcessor's layout: 9 ``<image>`` tokens, bos, prompt | suffix, with
``token_type_ids`` 0 over the prefix (bidirectional) and 1 over the suffix (causal); ours gets
``prefix_lens`` = the prefix length. Positions count from 1, as transformers' default.

Token ids are drawn from 3..289 (below the image token 290, never Gemma's pad 0, whose embedding row
transformers keeps gradient-free)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf_factory import saved_perturbed_pair
import torch.nn.functional as F
from safetensors.torch import load_file

from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import adapter_for
from omniweave.models.hf.verify_paligemma import patches

IMAGE, SIZE, PATCH, N_IMAGE, V, BOS = 290, 42, 14, 9, 301, 2


def _config(**over):
    from transformers import PaliGemmaConfig

    text = dict(model_type="gemma", vocab_size=V, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=3, num_key_value_heads=1, head_dim=20, bos_token_id=BOS)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=42, num_hidden_layers=2, num_attention_heads=3,
                  intermediate_size=50, image_size=SIZE, patch_size=PATCH, vision_use_head=False)  # fmt: skip
    return PaliGemmaConfig(**{"text_config": text, "vision_config": vision, "image_token_index": IMAGE,
                              "projection_dim": 48, "hidden_size": 48, **over})  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import PaliGemmaForConditionalGeneration

    path = tmp_path_factory.mktemp("paligemma") / "hf"
    hf, ours = saved_perturbed_pair(PaliGemmaForConditionalGeneration, _config(), path)
    return path, hf, ours


def make_doc(n_prompt: int, n_suffix: int, seed: int):
    """(input_ids [L], token_type_ids [L], image [1, 3, S, S], prefix length) of one document."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, IMAGE, (n_prompt + n_suffix,), generator=g)
    ids = torch.cat([torch.full((N_IMAGE,), IMAGE), torch.tensor([BOS]), text])
    prefix = N_IMAGE + 1 + n_prompt
    tt = (torch.arange(ids.numel()) >= prefix).long()
    return ids, tt, torch.randn(1, 3, SIZE, SIZE, generator=g), prefix


def packed(docs, prefixed: bool = True) -> dict:
    lengths = [d[0].numel() for d in docs]
    starts = torch.tensor([0, *lengths]).cumsum(0)
    batch = {"input_ids": torch.cat([d[0] for d in docs]),
             "position_ids": torch.cat([torch.arange(n) + 1 for n in lengths])[None],
             "cu_seqlens": starts.to(torch.int32), "pixel_values": patches(torch.cat([d[2] for d in docs]), PATCH),
             "grid_thw": torch.tensor([[1, 3, 3]] * len(docs)),
             "media_spans": torch.tensor([[int(s), N_IMAGE] for s in starts[:-1]])}  # fmt: skip
    if prefixed:
        batch["prefix_lens"] = torch.tensor([d[3] for d in docs])
    return batch


def _hf_logits(hf, doc, prefixed: bool) -> torch.Tensor:
    kw = {"token_type_ids": doc[1][None]} if prefixed else {}
    return hf(input_ids=doc[0][None], pixel_values=doc[2], **kw).logits[0]


@pytest.mark.parametrize("prefixed", [True, False], ids=["prefix_lm", "causal"])
def test_logits_match_transformers_with_and_without_the_prefix(pair, prefixed):
    """One document (9 image tokens + bos + 6 prompt | 7 suffix): logits within 1e-5 of HF's, with
    token_type_ids / prefix_lens (measured 9.5e-7 of logits up to 2.9) and without either (plain
    causal, 1.1e-6); the two masks give logits 0.73 apart, so the comparison sees which one ran."""
    _, hf, ours = pair
    doc = make_doc(6, 7, seed=1)
    with torch.no_grad():
        ref, got = _hf_logits(hf, doc, prefixed), ours.logits(packed([doc], prefixed))
        other = _hf_logits(hf, doc, not prefixed)
    assert ref.abs().max() > 1.0
    assert (got - ref).abs().max().item() <= 1e-5
    assert (other - ref).abs().max().item() > 0.05


def _grads_as_ours(hf) -> dict[str, torch.Tensor]:
    adapter = adapter_for("paligemma")
    grads = {adapter.model_name_to_ours(n): p.grad for n, p in hf.named_parameters()}
    return adapter.model_tensors_to_ours(grads)


def test_gradients_of_a_summed_loss_match_transformers(pair):
    """The summed next-token loss over the suffix, prefix-LM attention: loss within 1e-5 relative
    and every parameter's gradient (tower, projector, decoder; the tied embedding once) within 1e-5
    relative of HF's (measured: loss equal, gradients ≤ 1.1e-6)."""
    _, hf, ours = pair
    doc = make_doc(5, 8, seed=2)
    labels = torch.full_like(doc[0], -100)
    labels[doc[3] - 1:-1] = doc[0][doc[3]:]
    hf.zero_grad(), ours.zero_grad()
    ref_loss = F.cross_entropy(_hf_logits(hf, doc, True), labels, reduction="sum")
    ref_loss.backward()
    out = ours({**packed([doc]), "labels": labels})
    torch.testing.assert_close(out.loss_sum, ref_loss, atol=0, rtol=1e-5)
    out.loss_sum.backward()
    ref, worst = _grads_as_ours(hf), 0.0
    names = [n for n, _ in ours.named_parameters()]
    assert set(names) == set(ref) and any(n.startswith("image_encoder.blocks.1.") for n in names)
    for name, p in ours.named_parameters():
        assert ref[name].norm() > 0, name
        rel = ((p.grad - ref[name]).norm() / ref[name].norm()).item()
        assert rel <= 1e-5, (name, rel)
        worst = max(worst, rel)
    assert worst > 0  # measured 1.1e-6


def test_packed_row_of_two_documents_equals_transformers_on_each_alone(pair):
    """Two documents (own image, own prefix of 15 / 19 tokens) in one row: each document's logits
    equal HF's on it alone within 1e-5 (measured 1.3e-6 both ways), prefix-LM and causal."""
    _, hf, ours = pair
    docs = [make_doc(5, 6, seed=3), make_doc(9, 4, seed=4)]
    with torch.no_grad():
        for prefixed in (True, False):
            ref = torch.cat([_hf_logits(hf, d, prefixed) for d in docs])
            got = ours.logits(packed(docs, prefixed))
            assert (got - ref).abs().max().item() <= 1e-5, prefixed


def test_hf_to_omniweave_to_hf_round_trip_is_exact(pair, tmp_path):
    """The export holds the source's tensors bit for bit under its names (q / k / v split again,
    the tied head stored once, post_layernorm kept), the config reloads with the same sizes, and
    transformers on the export gives the source model's logits exactly."""
    from transformers import AutoModelForImageTextToText, PaliGemmaForConditionalGeneration

    path, hf, ours = pair
    export_hf(ours, None, tmp_path / "out")
    src, out = load_file(path / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert set(out) == set(src) and "lm_head.weight" not in out
    for k, t in src.items():
        assert torch.equal(out[k], t), k
    a, b = (json.loads(p.read_text()) for p in (path / "config.json", tmp_path / "out/config.json"))
    assert b["model_type"] == "paligemma" and b["image_token_index"] == IMAGE == a["image_token_index"]
    for section in ("text_config", "vision_config"):
        for k, v in b[section].items():
            if k in a[section] and k != "dtype":
                assert a[section][k] == v, (section, k)
    back = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back) is PaliGemmaForConditionalGeneration
    doc = make_doc(4, 5, seed=5)
    with torch.no_grad():
        assert torch.equal(_hf_logits(back, doc, True), _hf_logits(hf, doc, True))


def test_hf_verify_cli_passes_on_a_tiny_directory(pair, capsys):
    """``omniweave hf verify`` on the saved tiny directory: two documents packed vs each alone,
    random text (no tokenizer.json), random images through SiglipImageProcessorPil; exit 0 with
    logits prefix-LM and causal under the default atol 1e-4 (measured ~1e-6)."""
    from omniweave.cli import main

    path, _, _ = pair
    assert main(["hf", "verify", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "prefix_lens [" in printed and "logits causal" in printed and "OK: all differences" in printed, printed
    png = path.parent / "wide.png"
    from PIL import Image

    Image.new("RGB", (90, 30), (200, 40, 10)).save(png)
    assert main(["hf", "verify", str(path), "--image", str(png)]) == 0  # one file: both documents take it
    assert "OK: all differences" in capsys.readouterr().out
    assert main(["hf", "verify", str(path), "--video", str(png)]) == 2


def test_config_mapping_refuses_what_it_cannot_hold(pair):
    """A pooling head (vision_use_head, SiglipVisionConfig's default), a projection into another
    width, an image token outside the vocabulary, or a PaliGemma 2 (gemma2) text model: one clear
    error each."""
    path, _, _ = pair
    hf = json.loads((path / "config.json").read_text())
    adapter = adapter_for("paligemma")
    assert adapter.model_config(hf)["image_encoder"]["post_layernorm"] is True
    cases = {"vision_use_head": {**hf, "vision_config": {**hf["vision_config"], "vision_use_head": True}},
             "projection_dim": {**hf, "projection_dim": 32},
             "outside the text vocabulary": {**hf, "image_token_index": V},
             "only gemma": {**hf, "text_config": {**hf["text_config"], "model_type": "gemma2"}}}  # fmt: skip
    for match, cfg in cases.items():
        with pytest.raises(ValueError, match=match):
            adapter.model_config(cfg)


def test_shipped_yamls_build_and_the_tiny_recipe_exports_what_transformers_runs(tmp_path):
    """paligemma_3b_224 builds on meta with 2,923,466,480 parameters (SigLIP 412.4M, projector 2.4M,
    Gemma-2B at vocab 257216: 2508.7M) and exports PaliGemma's config; tiny_paligemma builds, and
    its export loads in transformers with logits within 1e-5 of ours (prefix-LM; measured 7.7e-7)."""
    from transformers import PaliGemmaForConditionalGeneration

    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import hf_config
    from omniweave.models.registry import build_model

    with torch.device("meta"):
        big = build_model(to_dict(load_recipe("paligemma_3b_224").model))
    assert sum(p.numel() for p in big.parameters()) == 2_923_466_480
    cfg = hf_config(big)
    assert cfg["image_token_index"] == 257152 and cfg["vision_config"]["num_hidden_layers"] == 27
    assert cfg["text_config"]["vocab_size"] == 257216 and cfg["vision_config"]["image_size"] == 224
    model_cfg = to_dict(load_recipe("tiny_paligemma").model)
    torch.manual_seed(0)
    ours = build_model(model_cfg)
    ours.init_weights()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_hf(ours, model_cfg, tmp_path / "out")
    hf = PaliGemmaForConditionalGeneration.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    image = hf.config.image_token_index
    g = torch.Generator().manual_seed(6)
    ids = torch.cat([torch.full((N_IMAGE,), image), torch.randint(3, 700, (12,), generator=g)])
    doc = (ids, (torch.arange(ids.numel()) >= 14).long(), torch.randn(1, 3, SIZE, SIZE, generator=g), 14)
    with torch.no_grad():
        assert (ours.logits(packed([doc])) - _hf_logits(hf, doc, True)).abs().max().item() <= 1e-5
