"""DeepSeek-V3 as a decoder family (multi-head latent attention + sigmoid-routed MoE with shared
experts): packed documents vs transformers' DeepseekV3ForCausalLM alone per document (q_lora_rank
set / None, rope default / yarn, interleaved or not, v head wider than qk), the group-limited
routing, HF's own save_pretrained directory, export, in-place loading, config errors, KV-cache
generation, the YAMLs. (Logits and every gradient on one sequence, and the export -> transformers
round trip, run with the other families in test_decoder_parity.py / test_hf_roundtrip.py.)"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from omniweave.models.components.decoder import DecoderConfig
from omniweave.models.components.mla import MLAttention
from omniweave.models.components.mlp import SwiGLU
from omniweave.models.components.moe import MoE
from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import load_hf, load_hf_into, read_hf_config
from omniweave.models.registry import build_component, build_model
from tests.hf_factory import DEEPSEEK_V3, save_tiny

REPO = Path(__file__).resolve().parents[1]
DOCS = (13, 6, 22)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _packed(vocab: int = 1024):
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in DOCS]
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    return docs, {"input_ids": torch.cat(docs), "position_ids": pos, "cu_seqlens": cu}


@pytest.fixture()
def pair(tmp_path):
    hf = save_tiny("deepseek_v3", tmp_path / "src")
    ours, cfg = load_hf(tmp_path / "src")
    return hf, ours, cfg, tmp_path


@pytest.mark.parametrize("variant", [
    {},  # q_lora_rank 24, yarn with mscale_all_dim, interleaved rope pairs
    {"q_lora_rank": None},
    {"rope_parameters": DEFAULT_ROPE},
    {"q_lora_rank": None, "rope_parameters": DEFAULT_ROPE, "rope_interleave": False},
    {"v_head_dim": 28, "attention_bias": True},  # v wider than q/k (12 + 8): q and k are the padded ones
], ids=["lora-yarn", "no-lora-yarn", "lora-plain", "no-lora-plain-halves", "wide-v-bias"])  # fmt: skip
def test_packed_documents_match_transformers(tmp_path, variant):
    """Logits (fp32, ≤ 1e-4) and the gradient of every parameter (relative ≤ 1e-4): one packed row
    of three documents through omniweave vs each document alone through transformers."""
    hf = save_tiny("deepseek_v3", tmp_path / "src", **variant)
    ours, _ = load_hf(tmp_path / "src")
    docs, packed = _packed()
    refs = [hf(input_ids=d[None]).logits[0] for d in docs]
    ref = torch.cat(refs)
    got = ours.logits(packed)
    assert (got - ref).abs().max().item() <= 1e-4
    labels = packed["input_ids"].roll(-1)
    sum(F.cross_entropy(r, labels[a:b], reduction="sum") for r, a, b in
        zip(refs, packed["cu_seqlens"][:-1].tolist(), packed["cu_seqlens"][1:].tolist())).backward()  # fmt: skip
    ours({**packed, "labels": labels}).loss_sum.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        hp = hf_params["model." + name[len("foundation.") :] if name != "foundation.lm_head.weight" else "lm_head.weight"]
        assert ((p.grad - hp.grad).norm() / hp.grad.norm()).item() <= 1e-4, name
    assert len(dict(ours.named_parameters())) == len(hf_params)


def test_group_limited_routing_is_binding_and_biased(pair):
    """Each token's experts lie in its 2 best of 4 groups; plain top-3 over all 8 experts would
    pick others for some tokens; e_score_correction_bias changes the choice, not the weights."""
    _, ours, _, _ = pair
    dec = ours.foundation
    gate = dec.layers[1].mlp.gate
    x = torch.randn(64, DEEPSEEK_V3["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, weights, idx = gate(x)
        groups = idx // 2  # 4 groups of 2 experts
        assert max(len(set(g)) for g in groups.tolist()) <= 2
        assert len({tuple(sorted(set(g))) for g in groups.tolist()}) >= 3  # tokens pick different groups
        scores = F.linear(x, gate.weight).sigmoid()
        free = (scores + gate.e_score_correction_bias).topk(3, dim=-1).indices
        assert (free.sort(-1).values != idx.sort(-1).values).any(-1).sum() >= 5
        unbiased = scores.gather(1, idx)
        torch.testing.assert_close(weights, 2.5 * unbiased / unbiased.sum(-1, keepdim=True), rtol=1e-6, atol=0)
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        assert not torch.equal(gate(x)[2].sort(-1).values, idx.sort(-1).values)
        gate.e_score_correction_bias.copy_(bias)


def test_hf_save_pretrained_dir_layers_and_config_round_trip(pair):
    hf, ours, cfg, tmp_path = pair
    with safe_open(str(tmp_path / "src/model.safetensors"), "pt") as st:  # transformers' own layout
        names = set(st.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names and "model.layers.1.mlp.gate.e_score_correction_bias" in names
    layers = ours.foundation.layers
    assert [type(lyr.mlp) for lyr in layers] == [SwiGLU, MoE, MoE]  # first_k_dense_replace=1
    assert all(isinstance(lyr.self_attn, MLAttention) for lyr in layers)
    assert torch.equal(layers[2].mlp.gate.e_score_correction_bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
    f = cfg["foundation"]
    assert f["head_dim"] is None and ours.foundation.config.head_dim == 20  # 12 + 8, not HF's rope-dim head_dim
    export_hf(ours, cfg, tmp_path / "out")
    back = read_hf_config(tmp_path / "out")
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "rope_interleave", "head_dim"):
        assert back[key] == getattr(hf.config, key), key  # fmt: skip
    assert back["rope_parameters"]["mscale_all_dim"] == 0.8 and back["num_nextn_predict_layers"] == 0


def test_export_writes_per_expert_tensors_and_the_bias(pair):
    _, ours, cfg, tmp_path = pair
    export_hf(ours, cfg, tmp_path / "out")
    moe = ours.foundation.layers[2].mlp
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as st:
        names = set(st.keys())
        for i in range(8):
            assert torch.equal(st.get_tensor(f"model.layers.2.mlp.experts.{i}.gate_proj.weight"), moe.experts.gate_up_proj[i, :24])
            assert torch.equal(st.get_tensor(f"model.layers.2.mlp.experts.{i}.up_proj.weight"), moe.experts.gate_up_proj[i, 24:])
        bias = st.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
        assert torch.equal(bias, moe.gate.e_score_correction_bias)
        assert st.get_tensor("model.layers.2.mlp.shared_experts.gate_proj.weight").shape == (48, 48)  # 2 x 24 wide
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.self_attn.q_a_layernorm.weight" in names


def test_load_into_materialised_model_copies_the_bias_buffer(pair):
    _, ours, cfg, tmp_path = pair
    fresh = build_model(cfg)
    assert not fresh.foundation.layers[1].mlp.gate.e_score_correction_bias.any()
    assert load_hf_into(fresh, tmp_path / "src") == len(dict(fresh.named_parameters())) + 2  # + 2 bias buffers
    for (n, a), b in zip(ours.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def test_mtp_layer_is_dropped_and_quantized_checkpoints_are_refused(pair):
    import json

    _, ours, _, tmp_path = pair
    sd = load_file(tmp_path / "src/model.safetensors")
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(48, 96)  # the released checkpoint's MTP layer (layer 61)
    sd["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(28, 48)
    save_file(sd, str(tmp_path / "src/model.safetensors"))
    again, _ = load_hf(tmp_path / "src")
    assert len(again.foundation.layers) == 3
    torch.testing.assert_close(again.logits({"input_ids": torch.arange(9)}), ours.logits({"input_ids": torch.arange(9)}))
    cfg = json.loads((tmp_path / "src/config.json").read_text())
    (tmp_path / "src/config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(NotImplementedError, match="quantized checkpoint \\(fp8\\).*dequantize"):
        load_hf(tmp_path / "src")


def test_released_config_layout_loads_and_exports_rope_type(pair):
    """The released config.json's 4.x keys (rope_theta, rope_scaling.type = yarn, n_routed_experts, no
    head_dim) give the same model; the export names the rope type as transformers 5 reads it."""
    import json

    hf, ours, _, tmp_path = pair
    cfg = json.loads((tmp_path / "src/config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg.pop("head_dim", None)
    (tmp_path / "src/config.json").write_text(json.dumps(cfg))
    legacy, model_cfg = load_hf(tmp_path / "src")
    ids = torch.arange(30) * 7
    torch.testing.assert_close(legacy.logits({"input_ids": ids}), ours.logits({"input_ids": ids}), rtol=0, atol=0)
    export_hf(legacy, model_cfg, tmp_path / "out")
    params = read_hf_config(tmp_path / "out")["rope_parameters"]
    assert params["rope_type"] == "yarn" and "type" not in params and params["factor"] == 4.0


_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
             family="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip


@pytest.mark.parametrize("bad,message", [
    ({"head_dim": 16}, r"head_dim=16: with MLA .* 8 \+ 4 = 12"),
    ({"num_kv_heads": 2}, r"num_kv_heads=2: MLA .* num_kv_heads = num_heads = 4"),
    ({"qk_rope_head_dim": 5}, r"qk_rope_head_dim=5 must be even"),
    ({"kv_lora_rank": 0}, r"needs kv_lora_rank, qk_rope_head_dim, v_head_dim > 0 .* kv_lora_rank=0"),
    ({"mrope_section": [1, 1, 1]}, r"mrope_section \[1, 1, 1\] must sum to 2 \(half the qk_rope_head_dim 4\)"),
    ({"moe_router": "relu"}, r"moe_router 'relu': choose from softmax, sigmoid"),
])  # fmt: skip
def test_inconsistent_config_is_named(bad, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**_TINY, **bad})


def test_mrope_positions_reach_the_rope_dims():
    """[3, L] positions: row 0 without mrope_section (equal to 1-D positions); with mrope_section over
    the rope dims, equal rows give the 1-D result and a differing h / w row changes the logits."""
    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/deepseek_v3_tiny.yaml").read_text())
    torch.manual_seed(0)
    model = build_model({"foundation": cfg})
    ids = torch.randint(0, 1024, (12,))
    pos1 = torch.arange(12)[None]
    moved = pos1.expand(3, -1).clone()
    moved[1:, 4:8] += 5  # a vision-like span: h / w rows differ from t
    with torch.no_grad():
        plain = model.logits({"input_ids": ids, "position_ids": pos1})
        torch.testing.assert_close(model.logits({"input_ids": ids, "position_ids": moved}), plain, rtol=0, atol=0)
        model.foundation.config.mrope_section = [1, 1, 2]  # sums to qk_rope_head_dim / 2 = 4
        torch.testing.assert_close(model.logits({"input_ids": ids, "position_ids": pos1.expand(3, -1)}), plain)
        diff = (model.logits({"input_ids": ids, "position_ids": moved}) - plain).abs().amax(-1)
        assert diff[:4].max() == 0 and diff[4:].min() > 1e-5  # causal: only tokens from the span on change


def test_kv_cache_greedy_equals_recompute(pair):
    """Generation on the packed-prompt KV cache (GroupKVCache) and on the one-sequence KVCache
    (NaiveRollout), both holding keys and padded values per head, equals recomputing the row."""
    from omniweave.generation import NaiveRollout, Prompt, SamplingParams
    from tests.test_decoder_parity import _greedy

    _, ours, _, _ = pair
    prompts = [{"input_ids": torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n))} for n in (9, 4)]
    got = _greedy(ours, prompts, 5)
    naive = NaiveRollout(ours).generate([Prompt(i, p) for i, p in enumerate(prompts)], 1,
                                        SamplingParams(temperature=0.0, max_new_tokens=5), seed=0)  # fmt: skip
    assert [r.tokens for r in naive] == got
    for prompt, tokens in zip(prompts, got):
        ids = prompt["input_ids"]
        with torch.no_grad():
            for tok in tokens:
                assert int(ours.logits({"input_ids": ids})[-1].argmax()) == tok
                ids = torch.cat([ids, torch.tensor([tok])])


def test_tiny_yaml_builds_trains_a_step_and_counts_flops():
    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/deepseek_v3_tiny.yaml").read_text())
    dec = build_component("foundation", cfg)
    assert [type(layer.mlp) for layer in dec.layers] == [SwiGLU, MoE, MoE]
    model = build_model({"foundation": cfg})
    ids = torch.randint(0, 1024, (24,))
    model({"input_ids": ids, "labels": ids.roll(-1)}).loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert dec.layers[1].mlp.experts.use_grouped_mm(torch.zeros(1, 72))
    # MFU counts: routed experts a token uses (3 of 8); attention width 6 heads x (qk 12 + 8 and v 16) / 2
    # (not the padded v of 20)
    from omniweave.train.metrics import model_flop_counts

    f = model.foundation
    routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel() for m in f.modules() if isinstance(m, MoE))
    dense = sum(p.numel() for n, p in f.named_parameters() if "embed_tokens" not in n)
    assert model_flop_counts(model) == (dense - routed * 5 // 8, 3, 6 * (20 + 16) // 2)


def test_real_size_yaml_has_the_published_parameter_count():
    """671B without the 14B multi-token-prediction layer (685B in the released safetensors)."""
    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/deepseek_v3.yaml").read_text())
    with torch.device("meta"):
        dec = build_component("foundation", cfg)
    n = sum(p.numel() for p in dec.parameters())
    assert abs(n - 671.0e9) / 671.0e9 < 0.001, n
    assert [type(dec.layers[i].mlp) for i in (0, 2, 3, 60)] == [SwiGLU, SwiGLU, MoE, MoE]
    assert dec.layers[0].self_attn.head_dim == 192 and dec.layers[0].self_attn.q_scale != 1.0  # yarn mscale folded in q


def test_vl_recipe_with_the_deepseek_backbone_refuses_hf_export(tmp_path):
    """tiny_deepseek_v3_vl trains (test_recipes.py) but transformers has no Qwen2.5-VL with an MLA
    backbone: export says so instead of writing a Qwen2 text config."""
    from omniweave.config import load_recipe

    model = build_model(load_recipe("tiny_deepseek_v3_vl").model)
    with pytest.raises(ValueError, match="qwen2 export needs a foundation of family qwen2; this one is deepseek_v3"):
        export_hf(model, {}, tmp_path / "out")


def test_mla_and_moe_refuse_tensor_parallel():
    from omniweave.parallel.tp import check_decoder_tp

    cfg = DecoderConfig(**_TINY)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        check_decoder_tp(cfg, 2)
