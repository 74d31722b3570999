"""Qwen3-MoE as a decoder family: packed documents vs transformers, the expert layouts of a
checkpoint (per-expert, fused), export, in-place loading, config fields, the tiny YAML, dense
models unchanged. (Logits / gradients on one sequence and the export round trip live in
test_decoder_parity.py and test_hf_roundtrip.py with the other families.)"""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from omniweave.models.components.mlp import SwiGLU
from omniweave.models.components.moe import MoE
from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import load_hf, load_hf_into, read_hf_config
from omniweave.models.registry import build_component, build_model
from tests.hf_factory import save_tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pair(tmp_path):
    hf = save_tiny("qwen3_moe", tmp_path / "src")
    ours, cfg = load_hf(tmp_path / "src")
    return hf, ours, cfg, tmp_path


def test_packed_documents_match_transformers(pair):
    hf, ours, _, _ = pair
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 1024, (n,), generator=g) for n in (13, 6, 22)]
    packed = {"input_ids": torch.cat(docs), "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
              "cu_seqlens": torch.tensor([0, 13, 19, 41], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=d[None]).logits[0] for d in docs])
        got = ours.logits(packed)
    assert (got - ref).abs().max().item() <= 1e-4


def test_layers_follow_hf_rule_and_config_round_trips(pair, tmp_path):
    hf, ours, cfg, _ = pair
    kinds = [type(layer.mlp) for layer in ours.foundation.layers]
    assert kinds == [MoE, SwiGLU, MoE]  # mlp_only_layers=[1]
    assert kinds == [type(m).__name__ == "Qwen3MoeSparseMoeBlock" and MoE or SwiGLU for m in (lyr.mlp for lyr in hf.model.layers)]
    f = cfg["foundation"]
    assert (f["num_experts"], f["num_experts_per_tok"], f["moe_intermediate_size"], f["mlp_only_layers"]) == (7, 3, 20, [1])
    assert read_hf_config(tmp_path / "src").get("num_local_experts") == 7  # transformers writes this name
    export_hf(ours, cfg, tmp_path / "out")
    back = read_hf_config(tmp_path / "out")
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"):
        assert back[key] == getattr(hf.config, key), key
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_experts == 7


def test_export_writes_per_expert_tensors(pair):
    _, ours, cfg, tmp_path = pair
    export_hf(ours, cfg, tmp_path / "out")
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as st:
        names = set(st.keys())
        e = ours.foundation.layers[2].mlp.experts
        for i in range(7):
            assert torch.equal(st.get_tensor(f"model.layers.2.mlp.experts.{i}.gate_proj.weight"), e.gate_up_proj[i, :20])
            assert torch.equal(st.get_tensor(f"model.layers.2.mlp.experts.{i}.up_proj.weight"), e.gate_up_proj[i, 20:])
            assert torch.equal(st.get_tensor(f"model.layers.2.mlp.experts.{i}.down_proj.weight"), e.down_proj[i])
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer


def test_fused_checkpoint_layout_is_read_by_name(pair):
    """A checkpoint holding transformers' runtime tensors ([E, 2I, D] gate_up, here 2I == D)."""
    hf, ours, _, tmp_path = pair
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused/config.json").write_text((tmp_path / "src/config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused/model.safetensors"))
    fused, _ = load_hf(tmp_path / "fused")
    for (n, a), b in zip(ours.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), n
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["model.layers.0.mlp.experts.gate_up_proj"] = sd["model.layers.0.mlp.experts.gate_up_proj"][:, :30].contiguous()
    save_file(sd, str(tmp_path / "fused/model.safetensors"))
    with pytest.raises(ValueError, match="gate_up_proj.*shape"):
        load_hf(tmp_path / "fused")


def test_missing_expert_is_named(pair):
    from safetensors.torch import load_file

    _, _, _, tmp_path = pair
    sd = load_file(tmp_path / "src/model.safetensors")
    del sd["model.layers.2.mlp.experts.4.up_proj.weight"]
    save_file(sd, str(tmp_path / "src/model.safetensors"))
    with pytest.raises(KeyError, match=r"layers.2.mlp.experts: no up_proj for expert\(s\) \[4\]"):
        load_hf(tmp_path / "src")


def test_load_into_materialised_model(pair):
    _, ours, cfg, tmp_path = pair
    fresh = build_model(cfg)
    assert load_hf_into(fresh, tmp_path / "src") == len(dict(fresh.named_parameters()))
    for (n, a), b in zip(ours.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def test_tiny_yaml_builds_and_trains_a_step():
    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    dec = build_component("foundation", cfg)
    assert [type(layer.mlp) for layer in dec.layers] == [MoE, SwiGLU]
    model = build_model({"foundation": cfg})
    ids = torch.randint(0, 1024, (24,))
    out = model({"input_ids": ids, "labels": ids.roll(-1)})
    out.loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert dec.layers[0].mlp.experts.use_grouped_mm(torch.zeros(1, 64))
    # MFU counts the routed experts a token uses (2 of 8)
    from omniweave.train.metrics import model_flop_counts

    e = dec.layers[0].mlp.experts
    dense = sum(p.numel() for n, p in model.foundation.named_parameters() if "embed_tokens" not in n)
    routed = e.gate_up_proj.numel() + e.down_proj.numel()
    assert model_flop_counts(model) == (dense - routed * 6 // 8, 2, 4 * 32)


def test_dense_model_is_unchanged():
    cfg = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_tiny.yaml").read_text())
    dec = build_component("foundation", cfg)
    assert all(type(layer.mlp) is SwiGLU for layer in dec.layers)
    assert not any("experts" in n or ".gate." in n for n in dec.state_dict())


def test_tp_plan_keeps_moe_layers_whole():
    """Under a tp foundation the MoE layers are gathered over the sequence and run unsharded on
    every tp rank (tests/dist/test_router_losses_parallel.py checks the numbers); only the dense
    layers' MLPs are split, so only their width must divide tp."""
    from omniweave.parallel.tp import MOE_UNDER_TP, decoder_plan

    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    plan = decoder_plan(build_component("foundation", f).config, 2)  # layer 0 MoE, layer 1 dense
    assert plan["layers.0.mlp"] is MOE_UNDER_TP and "layers.0.mlp.gate_proj" not in plan
    assert "layers.1.mlp.gate_proj" in plan and "layers.1.mlp.down_proj" in plan
    with pytest.raises(ValueError, match="intermediate_size=126 is not divisible by tp=4"):
        decoder_plan(build_component("foundation", {**f, "intermediate_size": 126}).config, 4)
    all_moe = build_component("foundation", {**f, "intermediate_size": 126, "mlp_only_layers": []}).config
    assert decoder_plan(all_moe, 4)["layers.1.mlp"] is MOE_UNDER_TP  # no dense MLP to split


def test_checkpoint_with_another_expert_count_is_refused(tmp_path):
    """A DCP checkpoint saved with 8 experts and a recipe asking for 4: a UserError naming the
    tensors and the key, before anything is read (training resume and ``load_model`` alike)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from omniweave.errors import UserError
    from omniweave.models.registry import build_model
    from omniweave.train import checkpoint

    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    model = build_model({"foundation": f})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpoint.save(tmp_path, 1, model, None, {"step": 1}, OmegaConf.to_yaml({"model": {"foundation": f}}))
        fewer = build_model({"foundation": {**f, "num_experts": 4}})
        with pytest.raises(UserError, match=r"num_experts.*experts.gate_up_proj: checkpoint \[8, 64, 64\], recipe \[4, 64, 64\]"):
            checkpoint.load(checkpoint.find_latest(tmp_path), fewer)
    finally:
        dist.destroy_process_group()
    with pytest.raises(UserError, match="num_experts"):
        checkpoint.load_model(tmp_path, {"foundation": {**f, "num_experts": 4}})


def test_flop_counts_use_active_parameters():
    """MFU (metrics.model_flop_counts) and the DP balancing cost model (decoder_params) count the
    k experts a token uses, not all E: equal to the dense model with the same active MLP width."""
    from omniweave.models.registry import build_model
    from omniweave.parallel.cost_model import decoder_params
    from omniweave.train.metrics import model_flop_counts

    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    model = build_model({"foundation": f})
    moe = model.foundation
    routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel() for m in moe.modules()
                 if hasattr(m, "experts"))
    total = sum(p.numel() for n, p in moe.named_parameters() if "embed_tokens" not in n)
    active = model_flop_counts(model)[0]
    assert active == total - routed * (1 - 2 / 8) == decoder_params(f)
    # one MoE layer (8 experts of 32, top-2) does the MLP work of a dense width-64 layer plus the router
    dense = {**f, "num_experts": 0, "intermediate_size": 64, "mlp_only_layers": []}
    assert decoder_params(f) - decoder_params(dense) == 8 * 64 + 3 * 64 * (128 - 64)  # router; layer 1's dense 128


@pytest.mark.parametrize("name", ["deepseek_v3_tiny", "deepseek_v3", "qwen3_moe_demo", "qwen2_5_tiny", "llama3_8b",
                                  "qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_next_tiny", "qwen3_5_35b_a3b"])
def test_cost_model_counts_what_mfu_counts(name):
    """The DP cost model's parameter formula (no weights) equals the model counted on the meta
    device by the MFU estimate: MLA attention, MoE layers with shared experts, dense models
    (DeepSeek-V3: 36.6B of 671B per token, the published '37B activated')."""
    from omniweave.models.registry import build_component
    from omniweave.parallel.cost_model import decoder_params
    from omniweave.train.metrics import foundation_flop_counts

    f = yaml.safe_load((REPO / f"omniweave/configs/models/foundation/{name}.yaml").read_text())
    with torch.device("meta"):
        counts = foundation_flop_counts(build_component("foundation", f))
    assert decoder_params(f) == counts[0]
    if name == "deepseek_v3":
        assert round(counts[0] / 1e9, 1) == 36.6


def test_qwen3_30b_a3b_yaml_has_the_published_sizes():
    """30,532,122,624 parameters (the HF checkpoint's safetensors total); 3.3B active per token
    (3.04B through the layers and LM head, plus the 0.31B embedding row lookup)."""
    from omniweave.train.metrics import foundation_flop_counts

    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_30b_a3b.yaml").read_text())
    with torch.device("meta"):
        dec = build_component("foundation", f)
    assert sum(p.numel() for p in dec.parameters()) == 30_532_122_624
    active = foundation_flop_counts(dec)[0] + dec.embed_tokens.weight.numel()
    assert 3.3e9 <= active < 3.4e9 and all(layer.routed for layer in dec.layers)  # 3.353B
