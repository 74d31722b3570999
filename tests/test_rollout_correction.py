"""Rollout/training mismatch correction (omniweave/rl/correction.py) and the vLLM engine's recipe
checks (omniweave/rl/vllm_engine.py), without vLLM: its version lookup is patched where needed.
Expected values are computed here from the formulas, not with the module's helpers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from omniweave.config import load_recipe, to_dict
from omniweave.errors import UserError
from omniweave.generation import Prompt, Rollout
from omniweave.models.lora import LoraConfig, add_adapter, merge_adapters
from omniweave.rl import vllm_engine
from omniweave.rl.batch import dummy_row, update_rows
from omniweave.rl.correction import correct_row, max_weight, metrics, resolve
from omniweave.rl.trainer import settings

PROMPT_LEN = 3


def make_row(engine_logps: list[list[float]], loss_agg: str = "token-mean") -> dict:
    """One update row of one text prompt and len(engine_logps) responses (one per list)."""
    ids = torch.tensor([11, 12, 13])
    prompt = Prompt(uid=0, batch={"input_ids": ids, "position_ids": torch.arange(PROMPT_LEN).expand(3, -1).clone()})
    rollouts = [Rollout(0, j, [20 + k for k in range(len(lp))], lp, False) for j, lp in enumerate(engine_logps)]
    g = len(rollouts)
    rows = update_rows([prompt], rollouts, torch.ones(g), [0], g, 64, loss_agg)
    assert len(rows) == 1
    return rows[0]


def loss_positions(row: dict) -> list[int]:
    return (row["labels"] != -100).nonzero()[:, 0].tolist()


def trainer_for(row: dict, per_token: list[float]) -> torch.Tensor:
    """Trainer log-probs: ``per_token`` on the loss tokens in order, 7.0 (must be dropped) elsewhere."""
    out = torch.full(row["labels"].shape, 7.0)
    out[loss_positions(row)] = torch.tensor(per_token)
    return out


def test_resolve_auto_by_engine_explicit_passthrough_bad_mode_names_choices():
    assert resolve("auto", "vllm") == "token_tis"
    assert resolve("auto", "native") == "none"
    assert resolve("auto", "native", off_policy=1) == "token_tis"  # the samples' policy is a step old
    for mode in ("none", "recompute", "token_tis", "seq_tis"):
        assert resolve(mode, "vllm") == mode and resolve(mode, "native") == mode
    with pytest.raises(ValueError, match="auto, none, recompute, token_tis, seq_tis.*'bogus'"):
        resolve("bogus", "vllm")


def test_token_tis_replaces_old_logp_keeps_engine_logp_and_weights_by_truncated_ratio():
    engine = [[-1.0, -2.0, -0.5], [-0.3, -1.5]]
    trainer = [-1.1, -1.0, -0.5, -0.4, -1.2]  # ratios e^-0.1, e^1 (> cap 2), 1, e^-0.1, e^0.3
    row = make_row(engine, loss_agg="seq-mean-token-mean")  # agg weights 1/3 and 1/2
    pos = loss_positions(row)
    assert len(pos) == 5
    cap = 2.0
    agg = [1 / 3] * 3 + [1 / 2] * 2
    stats = correct_row(row, trainer_for(row, trainer), "token_tis", cap)
    td = row["token_data"]
    flat_engine = sum(engine, [])
    expected_old = torch.zeros(row["labels"].shape)
    expected_old[pos] = torch.tensor(trainer)
    assert torch.equal(td["old_logp"], expected_old)
    expected_engine = torch.zeros(row["labels"].shape)
    expected_engine[pos] = torch.tensor(flat_engine)
    assert torch.equal(td["engine_logp"], expected_engine)
    w = [min(math.exp(t - e), cap) for t, e in zip(trainer, flat_engine)]
    expected_weights = torch.zeros(row["labels"].shape)
    expected_weights[pos] = torch.tensor([a * x for a, x in zip(agg, w)])
    torch.testing.assert_close(td["weights"], expected_weights)
    assert td["weights"][pos[1]].item() == pytest.approx(cap / 3)  # the truncated token gets exactly cap
    assert td["is_weight"][pos[1]].item() == cap
    off = torch.ones(row["labels"].shape, dtype=torch.bool)
    off[pos] = False
    assert not td["weights"][off].any() and not td["is_weight"][off].any()
    # stats: tokens, sum(engine - trainer), sum(rho - log rho - 1), sum of weights, count at cap
    d = [t - e for t, e in zip(trainer, flat_engine)]
    expected = [5, -sum(d), sum(math.exp(x) - x - 1 for x in d), sum(w), 1]
    assert stats.dtype == torch.float64
    torch.testing.assert_close(stats, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_token_tis_clamps_log_ratio_to_20_before_exp():
    row = make_row([[-60.0, -1.0]])
    correct_row(row, trainer_for(row, [-10.0, -1.0]), "token_tis", 1e12)  # log ratio 50 and 0
    w = row["token_data"]["is_weight"][loss_positions(row)]
    assert w[0].item() == pytest.approx(min(math.exp(20.0), 1e12), rel=1e-6)
    assert w[1].item() == 1.0


def test_seq_tis_one_weight_per_sequence_from_summed_log_ratio():
    engine = [[-1.0, -2.0, -0.5], [-0.3, -1.5]]
    trainer = [-0.9, -1.8, -0.4, -0.3, -3.5]  # sums +0.4 and -2.0
    row = make_row(engine)
    pos = loss_positions(row)
    cap = 1.3
    correct_row(row, trainer_for(row, trainer), "seq_tis", cap)
    flat_engine = sum(engine, [])
    d = [t - e for t, e in zip(trainer, flat_engine)]
    w1, w2 = min(math.exp(sum(d[:3])), cap), min(math.exp(sum(d[3:])), cap)
    assert w1 == cap and w2 == pytest.approx(math.exp(-2.0))
    expected = torch.zeros(row["labels"].shape)
    expected[pos] = torch.tensor([w1] * 3 + [w2] * 2)
    torch.testing.assert_close(row["token_data"]["weights"], expected)
    torch.testing.assert_close(row["token_data"]["is_weight"], expected)


def test_seq_tis_clamps_the_sequence_sum_not_each_token():
    """Tokens of log ratio +30 and -25 (each beyond the ±20 bound): the sequence's sum, +5, is
    what is clamped (and it is inside the bound), so the weight is exp(5); the KL statistic uses
    the unclamped ratios too."""
    row = make_row([[-40.0, -1.0]])
    stats = correct_row(row, trainer_for(row, [-10.0, -26.0]), "seq_tis", 1e12)
    pos = loss_positions(row)
    assert row["token_data"]["weights"][pos].tolist() == pytest.approx([math.exp(5.0)] * 2, rel=1e-5)
    assert stats[1].item() == pytest.approx(-5.0)  # sum(engine - trainer)


def test_recompute_replaces_old_logp_and_leaves_weights_unchanged():
    row = make_row([[-1.0, -2.0], [-0.5]], loss_agg="seq-mean-token-mean")
    before = row["token_data"]["weights"].clone()
    stats = correct_row(row, trainer_for(row, [-3.0, -0.1, -0.2]), "recompute", 2.0)
    pos = loss_positions(row)
    assert row["token_data"]["old_logp"][pos].tolist() == pytest.approx([-3.0, -0.1, -0.2])
    assert row["token_data"]["engine_logp"][pos].tolist() == [-1.0, -2.0, -0.5]
    assert torch.equal(row["token_data"]["weights"], before)
    assert stats[0].item() == 3 and stats[1].item() == pytest.approx((-1.0 + 3.0) + (-2.0 + 0.1) + (-0.5 + 0.2))


def test_dummy_row_contributes_zeros():
    for mode in ("recompute", "token_tis", "seq_tis"):
        row = dummy_row(8, 3)
        stats = correct_row(row, torch.randn(8), mode, 2.0)
        assert torch.equal(stats, torch.zeros(5, dtype=torch.float64))
        assert not row["token_data"]["weights"].any() and not row["token_data"]["old_logp"].any()
        assert max_weight([row]) == 0.0


def test_max_weight_over_rows_and_metrics_are_means_of_global_sums():
    a, b = make_row([[-1.0, -1.0]]), make_row([[-2.0]])
    correct_row(a, trainer_for(a, [-0.8, -1.0]), "token_tis", 5.0)
    correct_row(b, trainer_for(b, [-1.5]), "token_tis", 5.0)
    assert max_weight([a, b, dummy_row(4, 3)]) == pytest.approx(math.exp(0.5))
    assert max_weight([]) == 0.0 and max_weight([make_row([[-1.0]])]) == 0.0  # uncorrected rows: skipped
    m = metrics([4.0, 0.2, 0.1, 3.6, 1.0], 1.7)
    assert m == pytest.approx({"rollout/kl": 0.05, "rollout/k3_kl": 0.025, "rollout/is_mean": 0.9,
                               "rollout/is_max": 1.7, "rollout/is_clip_frac": 0.25})
    assert metrics([0.0] * 5, 0.0)["rollout/kl"] == 0.0  # no tokens: no division by zero


# ------------------------------------------------------------------------------ vLLM recipe checks


@pytest.fixture
def vllm_installed(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: "0.32.0")


def test_check_vllm_without_vllm_names_install_hint(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: None)
    with pytest.raises(UserError, match=r"omniweave\[vllm"):
        vllm_engine.check_vllm("qwen2_5_vl", 32)


def test_check_vllm_family_and_cpu_head_dim(vllm_installed):
    with pytest.raises(UserError, match="internvl.*rl.rollout.engine=native"):
        vllm_engine.check_vllm("internvl", 32)
    with pytest.raises(UserError, match=r"head dims \[32, 64.*the decoder's is 16") as e:
        vllm_engine.check_vllm("qwen2_5_vl", 16, "cpu")
    assert "\n" not in str(e.value)
    vllm_engine.check_vllm("qwen2_5_vl", 32, "cpu")
    vllm_engine.check_vllm("qwen2", 16, "cuda")  # the head-dim list is the CPU backend's


def test_demo_grpo_on_vllm_refused_for_its_head_dim_16(vllm_installed):
    cfg = load_recipe("demo_grpo", ["rl.rollout.engine=vllm"])
    with pytest.raises(UserError, match="16"):
        vllm_engine.check_vllm_recipe(cfg, to_dict(cfg.rl.rollout))
    with pytest.raises(UserError, match="16"):
        settings(cfg)


def test_demo_grpo_vllm_recipe_passes_and_refuses_cp_and_sleep_on_cpu(vllm_installed):
    cfg = load_recipe("demo_grpo_vllm")
    vllm_engine.check_vllm_recipe(cfg, to_dict(cfg.rl.rollout))
    cfg = load_recipe("demo_grpo_vllm", ["model.foundation.tp=2"])  # one engine over the tp group
    vllm_engine.check_vllm_recipe(cfg, to_dict(cfg.rl.rollout))
    cfg = load_recipe("demo_grpo_vllm", ["parallel.cp=2"])
    with pytest.raises(UserError, match="parallel.cp=2"):
        vllm_engine.check_vllm_recipe(cfg, to_dict(cfg.rl.rollout))
    if not torch.cuda.is_available():
        cfg = load_recipe("demo_grpo_vllm", ["rl.rollout.sleep=true"])
        with pytest.raises(UserError, match="rl.rollout.sleep"):
            vllm_engine.check_vllm_recipe(cfg, to_dict(cfg.rl.rollout))


def test_settings_validates_engine_and_correction_before_ranks_start():
    with pytest.raises(UserError, match="native or vllm.*bogus"):
        settings(load_recipe("demo_grpo", ["rl.rollout.engine=bogus"]))
    with pytest.raises(UserError, match="rl.rollout.correction"):
        settings(load_recipe("demo_grpo", ["rl.rollout.correction=bogus"]))
    with pytest.raises(UserError, match="token_tis.*recompute or none"):
        settings(load_recipe("demo_grpo", ["rl.rollout.correction=token_tis", "rl.importance_sampling=sequence",
                                           "rl.loss_agg=seq-mean-token-mean"]))
    assert settings(load_recipe("demo_grpo")).correction == "none"
    assert settings(load_recipe("demo_grpo", ["rl.rollout.off_policy=1"])).correction == "token_tis"


def test_settings_demo_grpo_vllm_resolves_token_tis(vllm_installed):
    assert settings(load_recipe("demo_grpo_vllm")).correction == "token_tis"


def test_merged_state_folds_lora_into_weight_and_drops_adapter_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    add_adapter(model[0], LoraConfig(r=2, alpha=6.0))  # scaling 3
    with torch.no_grad():
        model[0].lora_B.weight.copy_(torch.randn(3, 2))
    state = vllm_engine.merged_state(model)
    assert not any("lora_A" in k or "lora_B" in k for k in state)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    lin = model[0]
    expected = lin.weight + 3.0 * lin.lora_B.weight @ lin.lora_A.weight
    torch.testing.assert_close(state["0.weight"], expected.detach())
    assert torch.equal(state["2.weight"], model[2].weight)
    plain = copy.deepcopy(model)
    merge_adapters(plain)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(state[k], v)
