"""The VLA model (models/vla.py + components/action_expert.py) against references written here or
taken from transformers:

- an expert layer equals transformers' GemmaDecoderLayer when its adaRMS modulation is a constant
  (scale = the HF norm weight, shift 0, gate 1), layer by layer;
- a packed row of three frames gives the velocities, loss and gradients of Pi0.5's joint
  computation run on each frame alone (``compute_layer_complete``: both streams' q/k/v
  concatenated, one eager attention under ``make_att_2d_masks``), with random adaRMS modulations;
- ``sample_actions`` (prefix computed once) equals a dense 10-step Euler loop recomputing everything;
- knowledge insulation: same loss, no flow-loss gradient into the backbone;
- the model builds from YAML and refuses an expert that does not fit its backbone.
Sizes are not round: backbone width 48, expert width 32, 3 query heads of head_dim 20 over 1 kv head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from omniweave.models.components.action_expert import ExpertLayer
from omniweave.models.components.flow import att_2d_mask, euler_sample, flow_matching_targets
from omniweave.models.components.prefix_attention import PrefixLayout
from omniweave.models.components.rope import apply_rope, rope_cos_sin
from omniweave.models.registry import build_model

REPO = Path(__file__).resolve().parents[1]
H, A = 4, 5  # horizon, expert action width
EXPERT = {"name": "flow_expert", "hidden_size": 32, "intermediate_size": 40, "num_layers": 2, "num_heads": 3,
          "num_kv_heads": 1, "head_dim": 20, "action_dim": A, "horizon": H, "attn_backend": "sdpa"}


def tiny_vla(**expert):
    foundation = yaml.safe_load((REPO / "omniweave/configs/models/foundation/gemma_tiny.yaml").read_text())
    foundation["attn_backend"] = "sdpa"
    torch.manual_seed(0)
    model = build_model({"foundation": foundation, "action_expert": {**EXPERT, **expert}}).double()
    with torch.no_grad():  # non-trivial time conditioning: random modulations instead of the zero init
        for name, p in model.action_expert.named_parameters():
            if ".dense." in name:
                p.normal_(0, 0.05)
    return model


def vla_batch(prefix_lens=(7, 5, 9), dims=(3, 5, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    n, L = len(prefix_lens), sum(prefix_lens)
    return {
        "input_ids": torch.randint(1, 1024, (L,), generator=g),
        "labels": torch.full((L,), -100),
        "position_ids": torch.cat([torch.arange(p) for p in prefix_lens])[None],
        "cu_seqlens": torch.tensor([0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32),
        "prefix_lens": torch.tensor(prefix_lens),
        "action_docs": torch.arange(n),
        "actions": torch.randn(n, H, A, generator=g, dtype=torch.float64),
        "action_is_pad": torch.tensor([[False] * H, [False, False, True, True], [False] * H]),
        "action_dims": torch.tensor(dims),
        "action_noise": torch.randn(n, H, A, generator=g, dtype=torch.float64),
        "action_time": torch.rand(n, generator=g, dtype=torch.float64) * 0.999 + 0.001,
    }


def joint_velocity(model, ids, x_t, t):
    """Pi0.5's per-frame computation (lerobot compute_layer_complete): prefix tokens ``ids`` [P] and
    the noisy chunk ``x_t`` [H, A] go through every layer together, q / k / v of both streams
    concatenated, one eager attention under make_att_2d_masks; returns the velocity [H, A]."""
    fnd, exp = model.foundation, model.action_expert
    P, heads, hd = ids.shape[0], fnd.config.num_heads, fnd.config.head_dim
    cond = exp.time_condition(t[None], x_t.dtype)
    xp, xs = fnd.embed(ids), exp.action_in_proj(x_t)
    cos, sin = fnd.rope(torch.arange(P + H)[None])
    att = torch.tensor([0] * P + [1] + [0] * (H - 1))
    mask = att_2d_mask(att[None], torch.ones(1, P + H, dtype=torch.bool))[0]
    for bl, el in zip(fnd.layers, exp.layers):
        hp = bl.input_layernorm(xp)
        hs, gate = el.input_layernorm(xs, cond)
        a, b = bl.self_attn, el.self_attn
        q = torch.cat([a.q_proj(hp), b.q_proj(hs)]).view(P + H, -1, hd)
        k = torch.cat([a.k_proj(hp), b.k_proj(hs)]).view(P + H, -1, hd)
        v = torch.cat([a.v_proj(hp), b.v_proj(hs)]).view(P + H, -1, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v).reshape(P + H, -1)
        xp = xp + a.o_proj(out[:P])
        xp = xp + bl.mlp(bl.post_attention_layernorm(xp))
        xs = xs + gate * b.o_proj(out[P:])
        hs, gate = el.post_attention_layernorm(xs, cond)
        xs = xs + gate * el.mlp(hs)
    return exp.action_out_proj(exp.norm(xs, cond)[0])


def reference_loss(model, batch):
    ids, cu = batch["input_ids"], batch["cu_seqlens"].tolist()
    x_t, u_t = flow_matching_targets(batch["actions"], batch["action_noise"], batch["action_time"])
    total, count = 0.0, 0
    vs = []
    for n in range(len(cu) - 1):
        v = joint_velocity(model, ids[cu[n]:cu[n + 1]], x_t[n], batch["action_time"][n])
        vs.append(v)
        keep = ~batch["action_is_pad"][n]
        d = int(batch["action_dims"][n])
        total = total + ((v - u_t[n])[keep][:, :d] ** 2).sum()
        count += int(keep.sum()) * d
    return torch.stack(vs), total, count


def test_packed_frames_equal_pi05_joint_attention_per_frame():
    """Velocities of a packed row (3 frames, prefixes 7 / 5 / 9) equal the joint per-frame
    computation within 1e-10 (fp64); the masked loss sum and count equal the reference's (a
    frame with 2 padded steps, action widths 3 / 5 / 4), and the gradients of every parameter
    (backbone and expert) match within 1e-9 relative."""
    model, batch = tiny_vla(), vla_batch()
    prefix = model.prefix(batch)
    x_t, _ = flow_matching_targets(batch["actions"], batch["action_noise"], batch["action_time"])
    got_v = model.velocity(model.chunks(prefix, batch["action_docs"]), x_t, batch["action_time"])
    ref_v, ref_total, ref_count = reference_loss(model, batch)
    assert got_v.abs().max() > 1e-3
    assert (got_v - ref_v).abs().max().item() < 1e-10
    loss = model.flow_loss(model.prefix(batch), batch)
    assert int(loss.count) == ref_count == 3 * 4 + 5 * 2 + 4 * 4
    assert abs(loss.sum.item() - ref_total.item()) < 1e-9
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss.sum, params, allow_unused=True)
    ref = torch.autograd.grad(ref_total, params, allow_unused=True)
    checked = 0
    for (name, p), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], got, ref):
        # off the flow loss's path (the LM head, the last layer's prefix queries / MLP): None or zeros
        a, b = (torch.zeros_like(p) if g is None else g for g in (a, b))
        if b.abs().max() == 0:
            assert a.abs().max() == 0, name
            continue
        assert (a - b).abs().max().item() <= 1e-9 * max(1.0, b.abs().max().item()), name
        checked += 1
    assert checked > 20


def test_expert_layer_equals_transformers_gemma_layer():
    """With a constant modulation (dense weight 0, bias = [w, 0, 1]: scale w, shift 0, gate 1) an
    ExpertLayer is transformers' GemmaDecoderLayer with norm weights w, bidirectional: within 1e-6 on fp64 inputs
    (measured 7e-8; both compute norms and RoPE tables in fp32)."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding

    cfg = GemmaConfig(hidden_size=32, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1, head_dim=20,
                      hidden_activation="gelu_pytorch_tanh", vocab_size=50, attn_implementation="eager")
    torch.manual_seed(0)
    hf = GemmaDecoderLayer(cfg, 0).double().eval()
    for norm in (hf.input_layernorm, hf.post_attention_layernorm):
        torch.nn.init.normal_(norm.weight, std=0.3)
    ours = ExpertLayer(tiny_vla().action_expert.layers_config, 0).double()
    own = ours.state_dict()
    for name, value in hf.state_dict().items():
        if name.endswith("layernorm.weight"):
            dense = name.replace(".weight", "")
            own[f"{dense}.dense.weight"] = torch.zeros_like(own[f"{dense}.dense.weight"])
            own[f"{dense}.dense.bias"] = torch.cat([value, torch.zeros_like(value), torch.ones_like(value)])
        else:
            own[name] = value
    ours.load_state_dict(own)
    L = 11
    x = torch.randn(1, L, 32, dtype=torch.float64)
    pos = torch.arange(L)[None]
    cos_hf, sin_hf = GemmaRotaryEmbedding(cfg)(x, pos)
    ref = hf(x, attention_mask=None, position_ids=pos, position_embeddings=(cos_hf, sin_hf))
    ref = ref[0] if isinstance(ref, tuple) else ref
    cos, sin = rope_cos_sin(pos, 20, cfg.rope_parameters["rope_theta"])
    cu = torch.tensor([0, L], dtype=torch.int32)
    got = ours(x[0], torch.zeros(L, 32, dtype=torch.float64), cos.double(), sin.double(), cu,
               PrefixLayout(cu, torch.tensor([L])))
    assert (got - ref[0]).abs().max().item() < 1e-6  # measured 7e-8: both compute the norms and RoPE tables in fp32


def test_sampling_reuses_the_prefix_and_equals_a_dense_euler_loop():
    """sample_actions (prefix once, 10 expert-only steps) equals 10 Euler steps of the joint
    per-frame computation within 1e-10."""
    model, batch = tiny_vla(), vla_batch()
    noise = torch.randn(3, H, A, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = model.sample_actions(batch, noise)
    ids, cu = batch["input_ids"], batch["cu_seqlens"].tolist()
    with torch.no_grad():
        ref = torch.stack([
            euler_sample(lambda x, t, n=n: joint_velocity(model, ids[cu[n]:cu[n + 1]], x[0], t[0])[None],
                         noise[n:n + 1], 10)[0]
            for n in range(3)])
    assert (got - ref).abs().max().item() < 1e-10
    assert got.abs().max() > 1e-3


def test_knowledge_insulation_keeps_the_flow_loss_off_the_backbone():
    """Insulated: the loss is unchanged, the backbone's weights get no gradient from it, the
    expert's do; not insulated, the backbone's attention weights get one."""
    batch = vla_batch()
    losses = {}
    for insulate in (False, True):
        model = tiny_vla(knowledge_insulation=insulate)
        loss = model.flow_loss(model.prefix(batch), batch).sum
        loss.backward()
        losses[insulate] = loss.item()
        backbone = model.foundation.layers[0].self_attn.k_proj.weight.grad
        expert = model.action_expert.layers[0].self_attn.k_proj.weight.grad
        assert expert is not None and expert.abs().max() > 0
        if insulate:
            assert backbone is None or backbone.abs().max() == 0
        else:
            assert backbone.abs().max() > 0
    assert losses[False] == losses[True]


def test_expert_must_fit_its_backbone():
    """An expert whose depth / head_dim / kv heads differ from the backbone's is refused, naming them."""
    with pytest.raises(ValueError, match="layers: backbone 2, expert 3"):
        tiny_vla(num_layers=3)
    with pytest.raises(ValueError, match="head_dim: backbone 20, expert 16"):
        tiny_vla(head_dim=16)


def test_fresh_expert_starts_as_plain_norms_with_closed_gates():
    """init_weights zeroes every adaRMS modulation (weight and bias) after drawing the Linears:
    at step 0 the expert's residual branches are closed (gate 0), so its output is the projected
    noisy actions through the final norm only."""
    model = build_model({"foundation": yaml.safe_load((REPO / "omniweave/configs/models/foundation/gemma_tiny.yaml")
                                                     .read_text()), "action_expert": EXPERT})
    model.init_weights()
    dense = [p for n, p in model.action_expert.named_parameters() if ".dense." in n]
    assert dense and all(p.abs().max() == 0 for p in dense)
    assert model.action_expert.action_in_proj.weight.abs().max() > 0


def test_flow_objective_runs_through_the_forward_head():
    """FlowMatchingObjective through ``model(batch, head=...)`` (what the engine's executors call):
    row_inputs pads the chunks to the expert's width (3 -> 5 columns) and draws noise / time per
    chunk from (seed, step, sample index) -- the same for the same triple, new at another step; the
    loss equals the model's flow loss sum on that row, count() the real action values (30), and
    co-training adds text_weight × the labelled tokens' cross-entropy sum."""
    from omniweave.vla.objective import FlowMatchingObjective, action_values

    model, batch = tiny_vla(), vla_batch(dims=(3, 3, 3))
    batch = {k: v for k, v in batch.items() if k not in ("action_noise", "action_time")}
    batch.update(actions=batch["actions"][..., :3], action_samples=torch.tensor([11, 12, 13]))
    step = [5]
    objective = FlowMatchingObjective(seed=7, step=lambda: step[0])
    row = objective.row_inputs(model, batch)
    assert row["actions"].shape == (3, H, A) and (row["actions"][..., 3:] == 0).all()
    again = objective.row_inputs(model, batch)
    assert torch.equal(again["action_noise"], row["action_noise"]) and torch.equal(again["action_time"], row["action_time"])
    step[0] = 6
    assert not torch.equal(objective.row_inputs(model, batch)["action_noise"], row["action_noise"])
    assert ((row["action_time"] >= 0.001) & (row["action_time"] <= 1.0)).all()
    loss, stats = model(batch, head=objective.head(row))
    ref = model.flow_loss(model.prefix(batch), row)
    assert loss.item() == pytest.approx(ref.sum.item(), rel=1e-12)
    assert objective.count([batch]) == action_values(batch) == int(ref.count) == 3 * 10
    assert objective.metrics({k: v.item() for k, v in stats.items()})["flow_loss"] == pytest.approx(ref.mean.item())
    labelled = dict(batch, labels=batch["input_ids"].roll(-1))
    co_loss, co_stats = model(labelled, head=FlowMatchingObjective(text_weight=0.5, step=lambda: 6).head(row))
    text = model.loss_sum(model.prefix(labelled).hidden, labelled["labels"])
    assert co_loss.item() == pytest.approx(ref.sum.item() + 0.5 * text.item(), rel=1e-12)
    assert co_stats["text_tokens"].item() == batch["input_ids"].shape[0]
    with pytest.raises(ValueError, match="lacks actions"):
        objective.row_inputs(model, {k: v for k, v in batch.items() if k != "actions"})


def test_a_vision_language_directory_initialises_the_backbone_and_leaves_the_expert_fresh(tmp_path, caplog):
    """train.init_from of a VLM's HF directory (here the demo's Qwen2.5-VL-shaped model) into the
    VLA of the same backbone (demo_vla): every backbone tensor equals the directory's, the expert's
    keep their fresh values, and the log says so once (Pi0.5 starts from PaliGemma this way)."""
    import logging

    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import export_hf
    from omniweave.models.hf.loading import load_hf_into

    torch.manual_seed(1)
    vlm = build_model(to_dict(load_recipe("demo").model))
    vlm.init_weights()
    export_hf(vlm, to_dict(load_recipe("demo").model), tmp_path / "vlm")
    torch.manual_seed(2)
    vla = build_model(to_dict(load_recipe("demo_vla").model))
    vla.init_weights()
    fresh = {n: p.detach().clone() for n, p in vla.named_parameters() if n.startswith("action_expert.")}
    with caplog.at_level(logging.WARNING, logger="omniweave.hf"):
        load_hf_into(vla, tmp_path / "vlm")
    assert "the action expert's" in caplog.text
    source = dict(vlm.named_parameters())
    backbone = [n for n, _ in vla.named_parameters() if not n.startswith("action_expert.")]
    assert backbone and all(torch.equal(dict(vla.named_parameters())[n], source[n]) for n in backbone)
    assert all(torch.equal(p, fresh[n]) for n, p in vla.named_parameters() if n.startswith("action_expert."))


def test_mfu_counts_the_expert_on_its_chunk_tokens_not_the_rows():
    """The FLOP estimate behind a VLA run's MFU: the backbone's per-token parameters leave the
    expert out (it never sees the row's tokens); the objective adds 6·N_expert per chunk token and
    12·width per (query, key) pair per expert layer, each chunk's H queries over its prefix and itself."""
    from omniweave.train.metrics import expert_flop_counts, foundation_flop_counts, model_flop_counts
    from omniweave.vla.objective import FlowMatchingObjective

    model = tiny_vla()
    assert model_flop_counts(model) == foundation_flop_counts(model.foundation)
    n_expert = sum(p.numel() for p in model.action_expert.parameters())
    objective = FlowMatchingObjective(expert_counts=expert_flop_counts(model.action_expert), horizon=H)
    batch = vla_batch(prefix_lens=(7, 5, 9))
    pairs = H * ((7 + H) + (5 + H) + (9 + H))
    width = EXPERT["num_heads"] * EXPERT["head_dim"]
    assert objective.flops([batch]) == 6.0 * n_expert * 3 * H + 12.0 * EXPERT["num_layers"] * width * pairs
    assert FlowMatchingObjective().flops([batch]) == 0.0
