"""DPO (train/dpo.py, data/sources/preference.py, data/packing/pairs.py): the loss against a hand computation
and TRL's DPOTrainer code on the same log-probs; preference rows through convert (both layouts,
bad pairs counted); pairs kept together, media shared, through pack / loader / DP balancing; a
short training run whose first step is exactly log 2 (policy = reference)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from omniweave.cli import main as cli
from omniweave.train.dpo import DPOConfig, dpo_loss, pair_slots, sequence_logps
from tests.dpo_factory import dpo_overrides, make_pairs

POLICY = torch.tensor([[-3.0, -5.5], [-2.25, -1.0], [-7.0, -7.5]])  # [P, 2] (chosen, rejected)
REF = torch.tensor([[-3.5, -5.0], [-2.0, -1.5], [-6.0, -8.0]])
LENGTHS = torch.tensor([[2, 3], [1, 4], [5, 2]])


def _hand_loss(p, r, n, beta, loss, eps=0.0):
    out = []
    for (pc, pr), (rc, rr), (nc, nr) in zip(p.tolist(), r.tolist(), n.tolist()):
        if loss == "sigmoid":
            z = beta * ((pc - rc) - (pr - rr))
            out.append(-(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z))))
        else:
            out.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2)
    return out


@pytest.mark.parametrize("loss,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0)])
def test_the_dpo_loss_equals_a_hand_computation(loss, beta, eps):
    losses, chosen, rejected = dpo_loss(POLICY, REF, DPOConfig(beta, loss, eps), LENGTHS)
    assert losses.tolist() == pytest.approx(_hand_loss(POLICY, REF, LENGTHS, beta, loss, eps), rel=1e-6)
    assert chosen.tolist() == pytest.approx((beta * (POLICY[:, 0] - REF[:, 0])).tolist(), rel=1e-6)
    assert rejected.tolist() == pytest.approx((beta * (POLICY[:, 1] - REF[:, 1])).tolist(), rel=1e-6)


def _padded(token_logp: list[list[float]]):
    """Per-sequence token log-probs -> TRL's padded [2B, T] rows and mask (chosen rows first)."""
    T = max(len(t) for t in token_logp)
    lp, mask = torch.zeros(len(token_logp), T), torch.zeros(len(token_logp), T)
    for i, t in enumerate(token_logp):
        lp[i, : len(t)], mask[i, : len(t)] = torch.tensor(t), 1.0
    return lp, mask


@pytest.mark.parametrize("loss,beta,eps,trl_type", [("sigmoid", 0.1, 0.0, "sigmoid"), ("ipo", 0.3, 0.0, "ipo"),
                                                     ("sigmoid", 0.2, 0.25, "aot")])
def test_the_dpo_loss_equals_trls_on_the_same_logprobs(loss, beta, eps, trl_type):
    """TRL 1.x's sigmoid has no label smoothing; its ``aot`` loss is the label-smoothed sigmoid on
    sorted log-ratios, which for one pair at a time is exactly cDPO: compared pair by pair."""
    pytest.importorskip("trl")
    from tests.trl_dpo_reference import trl_dpo_loss

    g = torch.Generator().manual_seed(0)
    lengths = [[3, 5], [1, 2], [4, 4], [2, 6]]
    tokens = [[(-2 * torch.rand(n, generator=g)).tolist() for n in pair] for pair in lengths]
    ref = -3 * torch.rand(len(lengths), 2, generator=g)
    policy = torch.tensor([[sum(t) for t in pair] for pair in tokens])
    ours, chosen, rejected = dpo_loss(policy, ref, DPOConfig(beta, loss, eps), torch.tensor(lengths))
    groups = [range(len(lengths))] if trl_type != "aot" else [[p] for p in range(len(lengths))]
    for group in groups:
        lp, mask = _padded([tokens[p][0] for p in group] + [tokens[p][1] for p in group])
        theirs, metrics = trl_dpo_loss(lp, mask, ref[list(group), 0], ref[list(group), 1], trl_type, beta, eps)
        idx = list(group)
        assert float(ours[idx].mean()) == pytest.approx(theirs, rel=1e-5, abs=1e-7)
        assert float(chosen[idx].mean()) == pytest.approx(metrics["rewards/chosen"], rel=1e-5, abs=1e-7)
        assert float(rejected[idx].mean()) == pytest.approx(metrics["rewards/rejected"], rel=1e-5, abs=1e-7)
        assert float((chosen[idx] > rejected[idx]).float().mean()) == metrics["rewards/accuracies"]


def test_sequence_logps_sum_each_answers_tokens_in_a_packed_row():
    # two pairs in one row: docs of 4, 3, 5, 2 tokens; shifted labels -100 outside the answers
    labels = torch.tensor([-100, -100, 7, -100, -100, 8, -100, -100, -100, 5, 6, -100, 9, -100])
    cu = torch.tensor([0, 4, 7, 12, 14], dtype=torch.int32)
    slots = pair_slots(labels, cu, ["chosen", "rejected", "chosen", "rejected"])
    assert slots.tolist() == [0, 0, 1, 0, 0, 2, 0, 0, 0, 3, 3, 0, 4, 0]
    logp = -torch.arange(1, 15, dtype=torch.float32) / 10
    assert sequence_logps(logp, slots, 2).flatten().tolist() == pytest.approx([-0.3, -0.6, -2.1, -1.3])
    with pytest.raises(ValueError, match="alternate chosen, rejected"):
        pair_slots(labels, cu, ["chosen", "chosen", "rejected", "rejected"])


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_convert_reads_both_preference_layouts_and_counts_bad_pairs(tmp_path):
    from omniweave.data.sources.shards import RawDataset
    from tests.data_factory import png_bytes

    (tmp_path / "a.png").write_bytes(png_bytes(28, 28))
    rows = [
        {"conversations": [{"from": "human", "value": "<image>Colour?"}], "chosen": {"from": "gpt", "value": "red"},
         "rejected": {"from": "gpt", "value": "blue"}, "images": ["a.png"]},
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
         "rejected": {"role": "assistant", "content": [{"type": "text", "text": "green"}]}, "images": ["a.png"]},
        {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": "4"}},
        {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": "4", "rejected": " 4"},
    ]
    sharegpt, openai = tmp_path / "s.jsonl", tmp_path / "o.jsonl"
    _write_jsonl(sharegpt, [rows[0], rows[2], rows[3]])
    _write_jsonl(openai, [rows[1]])
    for src, out in ((sharegpt, "raw_s"), (openai, "raw_o")):
        assert cli(["data", "convert", "--input", str(src), "--output", str(tmp_path / out), "--workers", "1",
                    "--no-progress"]) == 0
    report = json.loads((tmp_path / "raw_s" / "convert_report.json").read_text())
    assert (report["written"], report["rejected_by_reason"]) == (1, {"preference_identical": 1,
                                                                      "preference_missing_side": 1})
    for out, rejected in (("raw_s", "blue"), ("raw_o", "green")):
        conv = RawDataset(str(tmp_path / out))[0].conversation
        assert [(m.role, m.content) for m in conv.messages] == [("user", "<image>Colour?"), ("assistant", "red")]
        assert conv.meta["rejected"] == rejected and conv.images == ["img0.png"]


def test_convert_reads_pairs_of_whole_conversations(tmp_path):
    """LLaMA-Factory's newer preference rows (issue 32, item 5): ``chosen_messages`` /
    ``rejected_messages`` sharing all turns but the last become the stored pair; sides that
    diverge earlier are a counted reject."""
    from omniweave.data.sources.shards import RawDataset

    prompt = [{"role": "user", "content": [{"type": "text", "value": "2+2?"}]},
              {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Well?"}]
    good = {"chosen_messages": [*prompt, {"role": "assistant", "content": "4"}],
            "rejected_messages": [*prompt, {"role": "assistant", "content": [{"type": "text", "value": "5"}]}]}
    early = {"chosen_messages": [*prompt, {"role": "assistant", "content": "4"}],
             "rejected_messages": [prompt[0], {"role": "assistant", "content": "No."}, prompt[2],
                                   {"role": "assistant", "content": "5"}]}
    _write_jsonl(tmp_path / "p.jsonl", [good, early])
    assert cli(["data", "convert", "--input", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "raw"),
                "--workers", "1", "--no-progress"]) == 0
    report = json.loads((tmp_path / "raw" / "convert_report.json").read_text())
    assert (report["written"], report["rejected_by_reason"]) == (1, {"preference_sides_diverge": 1})
    conv = RawDataset(str(tmp_path / "raw"))[0].conversation
    assert [(m.role, m.content) for m in conv.messages] == [
        ("user", "2+2?"), ("assistant", "Let me think."), ("user", "Well?"), ("assistant", "4")]
    assert conv.meta["rejected"] == "5"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return make_pairs(tmp_path_factory.mktemp("dpo"))


def test_pairs_stay_together_and_share_their_media_through_pack_and_balance(pairs):
    from omniweave.data.loading.loader import PackedLoader
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(pairs)
    assert ds.manifest["kind"] == "pairs"
    total = 0
    for i in range(len(ds)):
        rec = ds.record(i)
        docs = rec["docs"]
        assert [d["side"] for d in docs] == ["chosen", "rejected"] * (len(docs) // 2)
        assert all(a["index"] == b["index"] for a, b in zip(docs[::2], docs[1::2]))  # one pair, adjacent
        total += len(docs) // 2
        for m in rec["media"]:  # the rejected side's items point at the chosen side's, no bytes of their own
            if docs[m["doc"]]["side"] == "rejected":
                src = rec["media"][m["same_as"]]
                assert (src["doc"], m["size"], src["part"], src["length"]) == (m["doc"] - 1, 0, m["part"], m["length"])
            else:
                assert "same_as" not in m and m["size"] > 0
    assert total == 48
    seen = []
    for rank in range(2):  # cost-balanced over 2 dp ranks: every micro-batch holds whole pairs
        loader = PackedLoader(pairs, 4, dp_rank=rank, dp_size=2, balance="cost", kind="pairs")
        for mb in next(iter(loader)):
            slots = mb["token_data"]["pair_slot"]
            present = set(slots[slots > 0].tolist())
            assert present == set(range(1, 2 * mb["num_pairs"] + 1))  # both sides of every pair
            seen.append(mb)
    assert len(seen) == 4
    assert any("feature_rows" in mb for mb in seen)


def test_shared_media_features_give_the_same_logprobs_as_encoding_twice(pairs):
    """The pair's media encoded once (feature_rows to both sides) = each side encoding its own copy."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import _processor, collate_pack, media_batch, span_from_record
    from omniweave.data.packing.packed import PackedDataset
    from omniweave.models.registry import build_model

    ds = PackedDataset(pairs)
    i = next(i for i in range(len(ds)) if any("same_as" in m for m in ds.record(i)["media"]))
    pack = ds[i]
    shared = collate_pack(pack, ds.manifest["data_cfg"])
    bytes_of = {j: m["bytes"] for j, m in enumerate(pack["media"]) if "same_as" not in m}
    items = [(span_from_record(m), bytes_of[m.get("same_as", j)]) for j, m in enumerate(pack["media"])]
    twice = {k: v for k, v in shared.items() if k != "feature_rows"}
    twice.update(media_batch(_processor(ds.manifest["data_cfg"]), items))
    assert twice["grid_thw"].shape[0] == 2 * shared["grid_thw"].shape[0]
    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe("demo_dpo").model)).eval()
    with torch.no_grad():
        a = model(shared, token_logprobs=True).token_logp
        b = model(twice, token_logprobs=True).token_logp
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())


@pytest.mark.slow
def test_a_dpo_run_starts_at_log2_and_logs_rewards(pairs, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train
    from tests.train_factory import read_metrics

    train(load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path / "run", steps=3)))
    m = read_metrics(tmp_path / "run")
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference: every logit 0
    assert m[0]["reward_margin"] == 0.0 and m[0]["reward_accuracy"] == 0.0
    assert all(r["pairs"] > 0 and math.isfinite(r["loss"]) for r in m)
    assert m[-1]["reward_margin"] == pytest.approx(m[-1]["reward_chosen"] - m[-1]["reward_rejected"])
    assert m[-1]["loss"] != pytest.approx(math.log(2), abs=1e-4)  # the policy moved off the reference

    train(load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path / "free", steps=1, train__dpo__ref="none")))
    free = read_metrics(tmp_path / "free")[0]
    assert free["loss"] != pytest.approx(math.log(2), abs=1e-3)  # reference-free: raw log-prob margins


def test_bad_dpo_settings_and_data_fail_with_the_key(pairs, tmp_path):
    from omniweave.errors import UserError

    for key, value, match in (("loss", "hinge", "train.dpo.loss"), ("beta", "0", "train.dpo.beta"),
                              ("ref", "policy", "train.dpo.ref")):
        with pytest.raises(UserError, match=match):
            from omniweave.config import load_recipe
            from omniweave.train.trainer import check_ready, phase_kind

            cfg = load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path, **{f"train__dpo__{key}": value}))
            check_ready(cfg, None, kind=phase_kind(cfg))
    with pytest.raises(UserError, match="preference pairs"):  # DPO packs for an SFT run
        cfg = load_recipe("demo", dpo_overrides(pairs, tmp_path))
        check_ready(cfg, None, kind=phase_kind(cfg))


def test_sft_rows_packed_for_dpo_are_counted_as_not_pairs(tmp_path):
    from tests.data_factory import png_bytes  # noqa: F401 (same fixtures module as convert tests)

    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
            {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}],
             "rejected": {"role": "assistant", "content": "5"}}]
    _write_jsonl(tmp_path / "x.jsonl", rows)
    assert cli(["data", "convert", "--input", str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "raw"),
                "--workers", "1", "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "p"), "--recipe",
                "demo_dpo", "--workers", "1"]) == 0
    stats = json.loads((tmp_path / "p" / "stats.json").read_text())
    assert stats["samples_packed"] == 1
    assert "not_a_pair" in json.dumps(stats)


@pytest.mark.slow
def test_dpo_raises_the_rate_at_which_the_preferred_answer_wins(pairs, tmp_path):
    """The demo's measure (demo_dpo.py) on a short run: the share of pairs whose correct answer gets
    the higher log-prob rises from chance well above it (on the trained pairs; the full demo
    measures held-out ones: docs/dpo.md)."""
    from omniweave.config import load_recipe
    from omniweave.demo import load_trained_model
    from omniweave.demo_dpo import initial_model
    from omniweave.train.dpo import preference_accuracy
    from omniweave.train.trainer import train

    cfg = load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path / "run", steps=50, global_batch=4, train__lr=1e-2,
                                                train__schedule="constant", train__dpo__beta=0.5))
    before = preference_accuracy(initial_model(cfg), pairs)
    train(cfg)
    after = preference_accuracy(load_trained_model(tmp_path / "run", cfg), pairs)
    print(f"preferred answer wins: {before['accuracy']:.1%} -> {after['accuracy']:.1%} of {after['n']}")
    assert before["n"] == after["n"] == 48
    assert 0.3 <= before["accuracy"] <= 0.7  # the seeded initial model: chance
    assert after["accuracy"] >= before["accuracy"] + 0.2 and after["margin"] > before["margin"] + 1.0


@pytest.mark.slow
def test_a_resumed_dpo_run_equals_an_uninterrupted_one(pairs, tmp_path):
    """The reference is rebuilt from the initial weights, the loader position comes back."""
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train
    from tests.train_factory import read_metrics

    def run(out, resume=None):
        train(load_recipe("demo_dpo", dpo_overrides(pairs, out, steps=4, train__save_interval=2)), resume=resume)
        return [(m["loss"], m["reward_margin"]) for m in read_metrics(out)]

    whole = run(tmp_path / "whole")
    step2 = "checkpoints/step_000002"  # the run as it was at step 2
    shutil.copytree(tmp_path / "whole" / step2, tmp_path / "cut" / step2)
    assert run(tmp_path / "cut", resume="auto") == whole[2:]


@pytest.mark.slow
def test_with_lora_the_reference_is_the_policy_with_its_adapters_off(pairs, tmp_path, monkeypatch):
    """No frozen copy is built (models/lora.py's adapters_disabled gives the base); the first step
    starts at log 2 (fresh adapters: policy = base) and the run moves off it."""
    from omniweave.config import load_recipe
    from omniweave.train import dpo
    from omniweave.train.trainer import train
    from tests.train_factory import read_metrics

    def no_copy(*a, **k):
        raise AssertionError("a frozen reference copy was built for a LoRA-only run")

    monkeypatch.setattr(dpo, "frozen_reference", no_copy)
    lora = ["+model.foundation.lora={r: 4, alpha: 8, targets: all-linear}", "model.image_encoder.freeze=true",
            "model.projector.freeze=true"]
    train(load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path / "run", steps=3, train__lr=1e-3) + lora))
    m = read_metrics(tmp_path / "run")
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and m[0]["reward_margin"] == 0.0
    assert m[-1]["loss"] != pytest.approx(math.log(2), abs=1e-4)

    # a component trained in full beside the adapters: the adapters-off model moves too, so a copy is the reference
    with pytest.raises(AssertionError, match="frozen reference copy"):
        train(load_recipe("demo_dpo", dpo_overrides(pairs, tmp_path / "mixed", steps=1) + lora[:1]))


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_a_pair_whose_media_did_not_decode_is_left_out_of_loss_stats_and_normaliser(loss):
    """``drop_skipped_docs`` zeroes the skipped pair's slots (both sides share its media): the row then
    gives the loss, statistics, gradient and pair count of the same row without that pair."""
    from omniweave.train.dpo import DPOObjective, live_pairs
    from omniweave.train.objective import Target

    objective = DPOObjective.__new__(DPOObjective)
    objective.settings, objective.stored = DPOConfig(loss=loss), None
    objective.engine = type("E", (), {"dims": type("D", (), {"cp": 1})})
    slots = torch.tensor([0, 1, 1, 2, 2, 2, 0, 3, 3, 4, 4, 0])  # pairs 0 and 1 (chosen 1 / 3, rejected 2 / 4)
    token_logp = -torch.rand(12, generator=torch.Generator().manual_seed(0))
    ref = torch.tensor([[-1.0, -1.5], [-0.5, -2.0]])
    skipped = torch.where((slots == 3) | (slots == 4), 0, slots)  # pair 1's media did not decode
    assert (live_pairs(slots), live_pairs(skipped)) == (2, 1)

    def pair_loss(h, slots, pairs, ref):  # the objective on "hidden states" that are the token log-probs
        target = Target(torch.where(slots > 0, 1, -100), {"pair_slot": slots}, {"num_pairs": torch.tensor([pairs]),
                                                                               "ref_logps": ref})
        return objective.loss(_LogpModel(), h, target)

    x = token_logp.clone().requires_grad_()
    got, got_stats = pair_loss(x, skipped, 2, ref)
    got.backward()
    y = token_logp[:6].clone().requires_grad_()
    want, want_stats = pair_loss(y, slots[:6], 1, ref[:1])
    want.backward()
    assert torch.equal(got, want) and got_stats == want_stats and got_stats["pairs"] == 1.0
    assert torch.equal(x.grad[:6], y.grad) and not x.grad[6:].any()


class _LogpModel:
    """A model whose hidden states are the labels' log-probs already (objective unit tests)."""

    @staticmethod
    def token_logps(h, labels, temperature=1.0):
        return torch.where(labels != -100, h, 0.0)
