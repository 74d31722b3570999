"""DP load balancing (omniweave.parallel.balance / cost_model): the assignment's guarantees, the
cost model's FLOP coefficients and refit, and the loader's cost-balanced shares across ranks."""

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from omniweave.data.packing import bins as P
from omniweave.data.loading.loader import PackedLoader
from omniweave.parallel.balance import (NUM_FEATURES, CostModel, Refitter, assign, imbalance, nnls, pack_features,
                                        round_robin)
from tests.fakes_data import build_packed

# Qwen2.5-VL-7B shapes (omniweave/configs/models/foundation/qwen2_5_7b.yaml, image_encoder/qwen2_5_vit.yaml)
QWEN25_VL_7B = {
    "foundation": {"name": "decoder", "hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28, "num_heads": 28,
                   "num_kv_heads": 4, "vocab_size": 152064, "qkv_bias": True},
    "image_encoder": {"name": "qwen2_5_vit", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "patch_size": 14,
                      "temporal_patch_size": 2, "mlp": "swiglu", "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31]},
    "projector": {"name": "patch_merger", "merge_size": 2},
}


def mixture_pack_features(samples: int, capacity: int, seed: int) -> np.ndarray:
    """Features [K, F] of bfd packs of a mixture: text chats (~300 tokens, 60 %), single images
    (8..28 x 8..28 patches + ~150 tokens, 30 %), videos (8..48 temporal patches, 10 %)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, samples, p=[0.6, 0.3, 0.1])
    text = np.clip(rng.lognormal(np.log([300, 150, 100])[kind], 0.6), 8, None).astype(np.int64)
    grid = np.stack([np.where(kind == 2, rng.integers(8, 49, samples), 1),
                     2 * rng.integers(4, 15, samples), 2 * rng.integers(4, 15, samples)], 1) * (kind > 0)[:, None]
    length = text + grid.prod(1) // 4
    keep = length <= capacity
    length, grid = length[keep], grid[keep]
    return np.array([pack_features({"docs": [{"length": int(length[i])} for i in items],
                                    "media": [{"grid_thw": grid[i].tolist()} for i in items if grid[i, 0]]})
                     for items in P.pack(length, capacity).packs()])


cost_values = st.one_of(st.floats(0, 1e6, allow_nan=False), st.integers(0, 5).map(float))  # ints: many ties
costs_and_dp = st.integers(1, 8).flatmap(lambda dp: st.tuples(st.just(dp), st.integers(1, 8).flatmap(
    lambda m: st.lists(cost_values, min_size=dp * m, max_size=dp * m))))


@settings(max_examples=300, deadline=None)
@given(costs_and_dp)
@example((3, [6.0, 9.0, 1.0, 5.0, 7.0, 5.0, 5.0, 8.0, 4.0]))  # LPT + swaps stop at 18, contiguous is 17
def test_assign_is_never_worse_than_round_robin_and_gives_each_pack_once_g_over_dp_per_rank(case):
    dp, costs = case
    groups = assign(costs, dp)
    assert len(groups) == dp and all(len(g) == len(costs) // dp for g in groups)
    assert sorted(sum(groups, [])) == list(range(len(costs)))
    assert all(g == sorted(g) for g in groups)
    assert imbalance(costs, groups) <= imbalance(costs, round_robin(len(costs), dp)) * (1 + 1e-12)


def test_swaps_fix_what_lpt_leaves_and_the_contiguous_split_wins_when_better():
    loads = lambda costs, groups: sorted(sum(costs[j] for j in g) for g in groups)  # noqa: E731
    costs = [5.0, 3.0, 5.0, 4.0, 5.0, 8.0]  # LPT: {8, 5, 3} = 16 vs {5, 5, 4} = 14; one swap -> 15 / 15
    assert loads(costs, assign(costs, 2)) == [15.0, 15.0]
    costs = [6.0, 9.0, 1.0, 5.0, 7.0, 5.0, 5.0, 8.0, 4.0]
    assert loads(costs, assign(costs, 3)) == [16.0, 17.0, 17.0] == loads(costs, round_robin(9, 3))


def test_assign_is_deterministic_and_breaks_ties_by_index():
    assert assign([1.0] * 8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert assign([9.0, 1.0, 8.0, 2.0], 2) == [[0, 1], [2, 3]]
    costs = np.random.default_rng(0).lognormal(0, 1, 96)
    assert assign(costs, 12) == assign(costs.copy(), 12) == assign(list(costs), 12)


def test_permuting_tied_costs_permutes_positions_but_not_rank_loads():
    """Integer costs with many ties (sums exact): the ranks get the same cost multisets."""
    rng = np.random.default_rng(1)
    costs = rng.integers(1, 12, 64).astype(float)
    perm = rng.permutation(64)
    a, b = assign(costs, 8), assign(costs[perm], 8)
    # premise: LPT wins here (the round-robin fallback depends on positions, not only on values)
    assert imbalance(costs, a) < imbalance(costs, round_robin(64, 8))
    assert imbalance(costs[perm], b) < imbalance(costs[perm], round_robin(64, 8))
    assert [sorted(costs[g].tolist()) for g in a] == [sorted(costs[perm][g].tolist()) for g in b]


def test_lpt_and_swaps_reach_1_05_on_a_realistic_mixture_with_8_packs_per_rank():
    feats = mixture_pack_features(30_000, 8192, seed=0)
    costs = CostModel.from_model_config(QWEN25_VL_7B).cost(feats)
    rng = np.random.default_rng(2)
    worst_rr, worst = 0.0, 0.0
    for _ in range(10):
        batch = costs[rng.choice(len(costs), 64, replace=False)]  # dp 8 x 8 packs
        worst_rr = max(worst_rr, imbalance(batch, round_robin(64, 8)))
        worst = max(worst, imbalance(batch, assign(batch, 8)))
    assert worst <= 1.05 and worst_rr > 1.05, (worst, worst_rr)


def test_pack_features_are_the_documented_sums_from_metadata():
    rec = {"docs": [{"length": 100}, {"length": 30}],
           "media": [{"grid_thw": [1, 4, 6]}, {"grid_thw": [3, 2, 2]}]}
    assert pack_features(rec).tolist() == [100**2 + 30**2, 130, 2, 24**2 + 3 * 4**2, 24 + 12, 0, 0]
    assert pack_features({"docs": [{"length": 7}], "media": []}).tolist() == [49, 7, 1, 0, 0, 0, 0]
    # audio: one clip of one encoder item (5 tokens), one of two items (750 + 40 tokens): 2 frames a token
    rec["media"] += [{"kind": "audio", "start": 3, "length": 5},
                     {"kind": "audio", "start": 10, "length": 790, "pieces": [[10, 750], [760, 40]]}]
    assert pack_features(rec).tolist()[3:] == [24**2 + 3 * 4**2, 24 + 12, 10**2 + 1500**2 + 80**2, 10 + 1500 + 80]


def test_flop_model_coefficients_match_the_built_model():
    """b / 6 = the decoder's non-embedding parameters, p includes the ViT's and projector's."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    cfg = to_dict(load_recipe("demo", []).model)
    model = build_model(cfg)
    dec = sum(p.numel() for p in model.foundation.parameters()) - model.foundation.embed_tokens.weight.numel()
    vit = sum(p.numel() for p in model.image_encoder.parameters())
    proj = sum(p.numel() for p in model.projector.parameters()) / 4  # per patch: merge 2x2
    cm = CostModel.from_model_config(cfg)
    assert cm.b == 6 * dec
    assert cm.a == 6 * 2 * 64  # 6 x layers x heads x head_dim, as train.metrics.step_flops
    window_attention = 12 * 32 * (56 // 14) ** 2 * (3 - 1)  # 12 d W per patch in the 2 windowed blocks
    assert cm.p == 6 * vit + 6 * proj + window_attention
    assert cm.e == 12 * 32 * 1 and cm.c == cm.a * 128**2 / 2
    frozen = CostModel.from_model_config({**cfg, "image_encoder": {**cfg["image_encoder"], "freeze": True}})
    assert frozen.e == 4 * 32 and frozen.p == 2 * vit + 6 * proj + window_attention / 3 and frozen.b == cm.b


def test_cost_model_round_trips_through_to_dict_and_rejects_negative_coefficients():
    cm = CostModel.from_model_config(QWEN25_VL_7B)
    assert CostModel.from_dict(cm.to_dict()) == cm
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel(a=1.0, b=-1.0, c=0.0, e=0.0, p=0.0)


def test_nnls_matches_the_unconstrained_solution_when_positive_and_clamps_otherwise():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((50, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nnls(a, a @ x_true), x_true, atol=1e-10)
    y = a @ np.array([1.0, -2.0, 0.5, 3.0])
    x = nnls(a, y)
    free = np.linalg.lstsq(a[:, [0, 2, 3]], y, rcond=None)[0]  # KKT: the negative one leaves
    assert x[1] == 0.0 and np.allclose(x[[0, 2, 3]], free, atol=1e-10)


def test_refit_recovers_known_coefficients_from_noisy_timings_within_3_percent():
    """320 samples (40 steps x 8 ranks), each term 15-25 % of the time, 1 % noise + 0.05 s
    overhead per sample; the prior (7B FLOP model) has other proportions than the truth."""
    rng = np.random.default_rng(4)
    scale = np.array([4 * 8192**2 / 2, 4 * 8192, 120, 4 * 4e6, 4 * 8192 * 2, 0, 0])  # no audio
    truth = CostModel(*(np.array([0.25, 0.25, 0.15, 0.15, 0.2]) / (0.55 * scale[:5])).tolist())
    feats = rng.uniform(0.1, 1.0, (320, NUM_FEATURES)) * scale
    seconds = truth.cost(feats) * (1 + 0.01 * rng.standard_normal(320)) + 0.05
    refitter = Refitter(CostModel.from_model_config(QWEN25_VL_7B), warmup=40, skip=1)
    assert refitter.add(feats[:8], np.full(8, 100.0)) is None  # the skipped first step (would ruin the fit)
    out = [refitter.add(feats[8 * s : 8 * s + 8], seconds[8 * s : 8 * s + 8]) for s in range(40)]
    assert out[:39] == [None] * 39 and refitter.add(feats[:8], seconds[:8]) is None  # once: at the 40th
    fitted = out[39]
    rel = fitted.coefficients[:5] / truth.coefficients[:5] - 1
    assert np.abs(rel).max() < 0.03, rel
    assert fitted.f == fitted.q == 0.0  # unseen, and 0 in the prior
    full = CostModel.from_model_config(QWEN25_VL_7B).refit(feats, seconds)  # the same fit, direct
    assert np.allclose(full.coefficients, fitted.coefficients, rtol=1e-9)


def test_refit_falls_back_to_the_scaled_flop_model_and_keeps_unseen_features_in_proportion():
    prior = CostModel.from_model_config(QWEN25_VL_7B)
    rng = np.random.default_rng(5)
    feats = rng.uniform(1, 2, (4, NUM_FEATURES)) * 1e4
    few = prior.refit(feats, [1.0, 2.0, 3.0, 4.0])  # 4 samples < F + 2
    assert np.allclose(few.coefficients[:5] / prior.coefficients[:5], few.a / prior.a, rtol=1e-12)
    assert few.f == few.q == 0.0  # the 7B prior has no audio tower
    text = rng.uniform(0.1, 1, (200, NUM_FEATURES)) * np.array([1e8, 3e4, 100, 0, 0, 0, 0])  # no media at all
    fitted = prior.refit(text, prior.scaled(3e-12).cost(text))
    assert fitted.a == pytest.approx(3e-12 * prior.a, rel=0.02)
    assert fitted.e / fitted.a == pytest.approx(prior.e / prior.a, rel=1e-6)
    assert fitted.p / fitted.a == pytest.approx(prior.p / prior.a, rel=0.02)


def test_the_audio_tower_terms_come_from_its_config_and_refit_like_the_others():
    """A Qwen2-Audio-7B-shaped model: f = 12·d·layers (attention over an item's frames after the
    stem), q = 6 per tower parameter a frame runs (+ the linear projector on the pooled half)."""
    dec = {"name": "decoder", "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 32, "intermediate_size": 11008,
           "num_layers": 32, "vocab_size": 156032}
    audio = {"name": "qwen2_audio", "hidden_size": 1280, "num_layers": 32, "intermediate_size": 5120, "num_mel_bins": 128}
    prior = CostModel.from_model_config({"foundation": dec, "audio_encoder": audio,
                                         "audio_projector": {"name": "linear"}})
    per_frame = 2 * 3 * 128 * 1280 + 3 * 1280**2 + 32 * (4 * 1280**2 + 2 * 1280 * 5120)
    assert prior.f == 12 * 1280 * 32 and prior.q == 6 * per_frame + 6 * (1280 * 4096 + 4096) / 2
    frozen = CostModel.from_model_config({"foundation": dec, "audio_encoder": {**audio, "freeze": True},
                                          "audio_projector": {"name": "linear"}})
    assert frozen.f == 4 * 1280 * 32 and frozen.q == 2 * per_frame + 6 * (1280 * 4096 + 4096) / 2
    rng = np.random.default_rng(7)
    scale = np.array([2 * 4096**2, 4 * 4096, 20, 0, 0, 8 * 1500**2, 8 * 1500])
    truth = CostModel(*(np.array([0.3, 0.3, 0.1, 0, 0, 0.15, 0.15]) / (0.55 * np.maximum(scale, 1))).tolist())
    feats = rng.uniform(0.1, 1.0, (320, NUM_FEATURES)) * scale
    fitted = prior.refit(feats, truth.cost(feats) * (1 + 0.01 * rng.standard_normal(320)))
    rel = fitted.coefficients[[0, 1, 2, 5, 6]] / truth.coefficients[[0, 1, 2, 5, 6]] - 1
    assert np.abs(rel).max() < 0.03, rel


# ---------------------------------------------------------------------------- loader integration


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return build_packed(tmp_path_factory.mktemp("balance"), "--algorithm", "sequential")[1]


def _shares(loaders, steps):
    its = [ld.iter_pack_ids() for ld in loaders]
    return [[next(it) for it in its] for _ in range(steps)]  # [step][rank] -> pack ids


def test_loader_cost_balance_gives_every_pack_of_a_global_batch_to_exactly_one_rank(packed):
    G, dp, steps = 8, 4, 4
    batches = _shares([PackedLoader(packed, G, 0, 1, seed=3)], steps)
    ranks = [PackedLoader(packed, G, r, dp, seed=3, balance="cost") for r in range(dp)]
    shares = _shares(ranks, steps)
    for s in range(steps):
        assert sorted(sum(shares[s], [])) == sorted(batches[s][0]) and all(len(x) == G // dp for x in shares[s])
    ids = batches[0][0]
    stats = ranks[0].balance_stats(ids)
    costs = ranks[0].pack_costs(ids)
    assert stats["cost"] == pytest.approx(imbalance(costs, [[ids.index(i) for i in x] for x in shares[0]]))
    assert stats["cost"] <= stats["round_robin"]
    assert ranks[0].take_balance_stats(0) is None  # consumed batches' stats are not kept


def test_loader_keeps_the_stats_of_the_batch_it_balanced_for_the_trainer_to_log(packed):
    """take_balance_stats(position) hands over what assigning that batch computed, once."""
    loader = PackedLoader(packed, 8, 1, 4, seed=3, balance="cost")
    it = iter(loader)
    start = loader.position(loader.epoch, loader.cursor)
    ids, _, _ = loader.global_batch_ids(loader.epoch, loader.cursor)
    next(it)
    assert loader.take_balance_stats(start) == loader.balance_stats(ids)
    assert loader.take_balance_stats(start) is None


def test_loader_resume_makes_the_same_assignments_with_a_cost_model_switched_mid_run(packed):
    """Uninterrupted: 6 steps, ``set_cost_model`` after step 2. Interrupted: state after step 4
    -> fresh loaders (dp 2) continue with the same shares; the switch changes some assignment."""
    G, dp = 4, 2
    other = CostModel(a=0.0, b=0.0, c=1.0, e=0.0, p=0.0)  # documents only: a different ranking

    def run(switch: bool):
        ranks = [PackedLoader(packed, G, r, dp, seed=1, balance="cost") for r in range(dp)]
        its = [ld.iter_pack_ids() for ld in ranks]
        steps, states = [], []
        for s in range(6):
            if switch and s == 2:
                for ld in ranks:
                    ld.set_cost_model(other)
            steps.append([next(it) for it in its])
            states.append(ranks[0].state_dict())
        return steps, states

    full, states = run(switch=True)
    assert full != run(switch=False)[0]
    resumed = [PackedLoader(packed, G, r, dp, seed=1, balance="cost") for r in range(dp)]
    for ld in resumed:
        ld.load_state_dict(json.loads(json.dumps(states[3])))  # as the trainer's trainer_state.json
    assert _shares(resumed, 2) == full[4:]
    assert states[3]["cost_models"] == [{"from": 4 * G, **other.to_dict()}]


def test_loader_resume_matches_when_workers_had_assigned_batches_ahead_of_the_switch(packed):
    """With a DataLoader worker, batches are assigned ``prefetch`` steps ahead: a model set after
    step 2 starts at the first unassigned batch, and the state after step 3 says so."""
    G, dp = 4, 2
    other = CostModel(a=0.0, b=0.0, c=1.0, e=0.0, p=0.0)
    ld = PackedLoader(packed, G, 1, dp, seed=1, balance="cost", num_workers=1, prefetch_factor=2)
    it = iter(ld)
    got = []
    for s in range(6):
        if s == 2:
            ld.set_cost_model(other)
        got.append([mb["input_ids"].tolist() for mb in next(it)])
        if s == 2:
            state = ld.state_dict()
    assert [d["from"] for d in state["cost_models"]] == [3 * G, 4 * G]  # old model for batch 4, then the new
    resumed = PackedLoader(packed, G, 1, dp, seed=1, balance="cost")
    resumed.load_state_dict(json.loads(json.dumps(state)))
    shares = [step[0] for step in _shares([resumed], 3)]
    assert [[resumed.dataset[i]["input_ids"].tolist() for i in share] for share in shares] == got[3:]
