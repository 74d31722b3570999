"""KTO as a training mode (train.phase=kto): its packed rows (data/packing/kto.py: completions,
then the pack's KL documents prompt_i ‖ answer_(i+1)), their per-token slots (loader.collate_pack),
the objective (train/kto.py) on a packed row against TRL 1.16's ``KTOTrainer._compute_loss``, and
its layout refusals. Layout parity (dp 2, cp 2, chunked rows): tests/dist/test_objective_layouts.py,
tests/test_objective_chunks.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniweave.train.preference import KTOConfig

TOL = 1e-6


@pytest.fixture(scope="module")
def completions(tmp_path_factory):
    from tests.dpo_factory import make_kto

    return make_kto(tmp_path_factory.mktemp("kto"), completions=24)


def test_each_pack_holds_its_completions_then_their_kl_documents(completions):
    """n completions then n KL documents: KL document i is completion i's prompt (its tokens, its
    media, shared not copied) then completion i+1's answer (its tokens and labels, positions
    continuing the prompt's); the two halves hold equally many tokens."""
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(completions)
    assert ds.manifest["kind"] == "kto" and len(ds) > 1
    seen = 0
    for k in range(len(ds)):
        p = ds[k]
        docs, cu = p["docs"], p["cu_seqlens"].tolist()
        n = len(docs) // 2
        assert [("kto" in d, bool(d.get("kto_kl"))) for d in docs] == [(True, False)] * n + [(False, True)] * n
        assert cu[n] * 2 == cu[-1]  # the KL documents hold exactly the completions' tokens
        seen += n

        def part(d):
            return slice(cu[d], cu[d + 1])

        for i in range(n):
            j = (i + 1) % n
            a_i, a_j = docs[i]["answer_start"], docs[j]["answer_start"]
            kl, mine, theirs = part(n + i), part(i), part(j)
            want_ids = np.concatenate([p["input_ids"][mine][:a_i], p["input_ids"][theirs][a_j:]])
            assert np.array_equal(p["input_ids"][kl], want_ids)
            pos = p["position_ids"][:, kl]
            assert np.array_equal(pos[:, :a_i], p["position_ids"][:, mine][:, :a_i])
            tail = pos[:, a_i:]
            assert (tail == tail[:1]).all() and np.array_equal(tail[0], pos[:, :a_i].max() + 1 + np.arange(tail.shape[1]))
            # the answer's labels: scored from the answer's first token on (shifted within the doc)
            assert (p["labels"][kl][: a_i - 1] == -100).all() and (p["labels"][kl][a_i - 1:-1] != -100).all()
        mine_media = [m for m in p["media"] if m["doc"] < n]
        kl_media = [m for m in p["media"] if m["doc"] >= n]
        assert all("same_as" not in m for m in mine_media) and all(m["size"] == 0 for m in kl_media)
        assert [p["media"][m["same_as"]]["doc"] + n for m in kl_media] == [m["doc"] for m in kl_media]
    assert seen == 24  # every completion packed


def test_a_kl_document_of_a_completion_with_itself_is_that_completion(tmp_path_factory):
    """kl_document(prompt of x, answer of x) rebuilds x token for token: ids, labels, M-RoPE
    positions (images in the prompt), media."""
    from omniweave.cli import main as cli
    from omniweave.data.packing.kto import kl_document, tokenize_kto
    from omniweave.data.packing.pack import data_config
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenize import SampleProcessor

    root = tmp_path_factory.mktemp("kto_raw")
    assert cli(["data", "demo", str(root / "d"), "--samples", "0", "--eval-samples", "0", "--rl-samples", "0",
                "--dpo-samples", "0", "--kto-samples", "4"]) == 0
    assert cli(["data", "convert", "--input", str(root / "d" / "kto.jsonl"), "--media-dir", str(root / "d" / "media"),
                "--output", str(root / "raw"), "--workers", "1", "--no-progress"]) == 0
    data_cfg, _, _ = data_config("demo_kto", 256, [])
    proc = SampleProcessor(data_cfg)
    raw = RawDataset(root / "raw")
    with_images = 0
    for i in range(len(raw)):
        [(doc, info)] = tokenize_kto(proc, raw[i])
        assert info["kto"] == raw[i].conversation.meta["kto_tag"]
        again = kl_document(doc, info["answer_start"], doc, info["answer_start"])
        assert np.array_equal(again.input_ids, doc.input_ids) and np.array_equal(again.labels, doc.labels)
        assert np.array_equal(again.position_ids, doc.position_ids) and again.media == doc.media
        with_images += bool(doc.media) and doc.position_ids.shape[0] == 3
    assert with_images >= 2


def test_rows_without_a_kto_tag_are_counted_rejects(tmp_path):
    """SFT rows packed with a KTO recipe: every one rejected as ``no_kto_tag`` in stats.json (and a
    error when nothing is left); too long for twice its length: ``too_long``."""
    from omniweave.cli import main as cli

    assert cli(["data", "demo", str(tmp_path / "d"), "--samples", "6", "--eval-samples", "0", "--rl-samples", "0",
                "--dpo-samples", "0", "--kto-samples", "6"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    rows += [json.loads(x) for x in (tmp_path / "d" / "kto.jsonl").read_text().splitlines()]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["data", "convert", "--input", str(tmp_path / "mixed.jsonl"), "--media-dir", str(tmp_path / "d" / "media"),
                "--output", str(tmp_path / "raw"), "--workers", "1", "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "p"), "--recipe",
                "demo_kto", "--max-len", "256", "--workers", "1"]) == 0
    stats = json.loads((tmp_path / "p" / "stats.json").read_text())
    assert stats["dropped"] == {"no_kto_tag": 6} and stats["samples_packed"] == 6
    assert cli(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "short"), "--recipe",
                "demo_kto", "--max-len", "40", "--workers", "1"]) == 2  # nothing fits: a one-line error
    stats = json.loads((tmp_path / "short" / "stats.json").read_text())
    assert stats["dropped"] == {"no_kto_tag": 6, "too_long": 6} and stats["packs"] == 0


def test_collated_rows_carry_each_answer_tokens_slot_and_desirability(completions):
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(completions)
    p = ds[0]
    mb = collate_pack(p, ds.manifest["data_cfg"])
    n, slots, good = mb["num_kto"], mb["token_data"]["kto_slot"], mb["token_data"]["kto_desirable"]
    cu = mb["cu_seqlens"].tolist()
    assert n == len(p["docs"]) // 2
    for d in range(2 * n):
        scored = mb["labels"][cu[d]:cu[d + 1]] != -100
        assert (slots[cu[d]:cu[d + 1]][scored] == 1 + d).all() and (slots[cu[d]:cu[d + 1]][~scored] == 0).all()
        want = float(d < n and p["docs"][d]["kto"])
        assert (good[cu[d]:cu[d + 1]][scored] == want).all() and (good[cu[d]:cu[d + 1]][~scored] == 0).all()


class _Model:
    """Hidden states that are the labels' log-probs already; its forward reports the row's."""

    def __init__(self, logp):
        self.logp = logp

    def __call__(self, mb, token_logprobs=True):
        return SimpleNamespace(token_logp=self.logp.detach())

    @staticmethod
    def token_logps(h, labels, temperature=1.0):
        return torch.where(labels != -100, h, 0.0)


@pytest.mark.parametrize("loss, z0_sign", [("kto", 1.0), ("kto", -1.0), ("apo_zero_unpaired", 1.0)])
def test_kto_objective_on_a_packed_row_equals_trl(loss, z0_sign):
    """Nine completions of unequal lengths and their nine KL documents packed in one row (two prompt
    tokens before each answer): the objective's pre-pass z0, row inputs and loss give TRL 1.16's
    loss (mean over the completions), its gradient w.r.t. the token log-probs and its kl."""
    from omniweave.train.kto import KTOObjective, kto_token_data
    from omniweave.train.objective import Target
    from tests.test_objectives_trl import _Gatherer, _kto_case, _trl_kto

    case = _kto_case(9, seed=4 + int(z0_sign), z0_sign=z0_sign)
    tokens, mask, kl_tokens, kl_mask, ref, ref_kl, desirable = case
    cfg = KTOConfig(beta=0.3, desirable_weight=1.0, undesirable_weight=1.33, loss=loss).validate()
    x = tokens.clone().requires_grad_()
    want, metrics = _trl_kto(x, *case[1:], cfg, _Gatherer())
    want.backward()
    # the packed row: per document 2 prompt tokens then the answer's; the reference's sequence sums
    # sit on each answer's first token (the objective sums them over the answer)
    n = len(desirable)
    logp, ref_tok, labels, lengths, where = [], [], [], [], []
    for d, (t, m, r) in enumerate([*zip(tokens, mask, ref), *zip(kl_tokens, kl_mask, ref_kl)]):
        k = int(m.sum())
        where.append((len(labels) + 2, k))
        logp += [0.0, 0.0, *t[:k].tolist()]
        ref_tok += [0.0, 0.0, float(r), *[0.0] * (k - 1)]
        labels += [-100, -100, *[1] * k]
        lengths.append(k + 2)
    y = tokens.clone().requires_grad_()
    h = torch.zeros(len(labels))
    for d in range(n):
        s, k = where[d]
        h = h.index_put((torch.arange(s, s + k),), y[d, :k])
    labels = torch.tensor(labels)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    docs = [{"kto": bool(g)} for g in desirable] + [{"kto_kl": True}] * n
    token_data, num = kto_token_data(labels, cu, docs)
    mb = {"labels": labels, "token_data": token_data, "num_kto": num}
    engine = SimpleNamespace(dims=SimpleNamespace(cp=1), device=torch.device("cpu"),
                             meshes=SimpleNamespace(dp_cp=SimpleNamespace(size=lambda: 1)))
    objective = object.__new__(KTOObjective)
    objective.settings, objective.engine, objective.z0, objective._reference_sums = cfg, engine, None, []
    objective.reference = SimpleNamespace(token_logps=lambda model, mb: torch.tensor(ref_tok))
    model = _Model(torch.tensor(logp))
    objective.prepare_step(model, [mb])
    row = objective.row_inputs(model, mb)
    got, stats = objective.loss(model, h, Target.of(mb, row))
    (got / n).backward()
    d_loss, d_grad = abs(float(got.detach() / n - want.detach())), (y.grad - x.grad).abs().max().item()
    print(f"kto objective {loss} z0_sign={z0_sign}: |Δloss| {d_loss:.1e}, |Δgrad| {d_grad:.1e}, z0 "
          f"{float(objective.z0):.4f}")
    assert d_loss <= TOL and d_grad <= TOL and x.grad.abs().max() > 1e-3
    if loss == "kto":
        assert float(objective.z0) == pytest.approx(metrics["kl"][0], abs=TOL)
    assert int(stats["completions"]) == n and int(stats["desirable"]) == int(desirable.sum())
    out = {k: float(v) for k, v in stats.items()}
    m = objective.metrics(out)
    assert m["reward_desirable"] == pytest.approx(metrics["rewards/chosen"][0], abs=TOL)
    assert m["reward_undesirable"] == pytest.approx(metrics["rewards/rejected"][0], abs=TOL)


def test_kto_under_a_pipeline_is_refused_in_one_line():
    from omniweave.train.layouts import MODES, Layout, refusals

    why = refusals(MODES["KTO"], Layout(pp=2))
    assert len(why) == 1 and why[0].startswith("train.phase=kto under parallel.pp=2: the frozen reference's forward")
    assert refusals(MODES["KTO"], Layout(cp=2)) == [] and refusals(MODES["KTO"], Layout(seq_chunks=2)) == []


def test_bad_kto_settings_are_refused_before_any_rank_starts():
    from omniweave.config import load_recipe
    from omniweave.errors import UserError
    from omniweave.train.trainer import phase_kind

    assert phase_kind(load_recipe("demo_kto", [])) == "kto"
    with pytest.raises(UserError, match=r"^train\.kto\.beta must be a finite number > 0, got 0\.0$"):
        phase_kind(load_recipe("demo_kto", ["train.kto.beta=0"]))
    with pytest.raises(UserError, match=r"^train\.kto\.loss must be one of kto, apo_zero_unpaired, got 'sigmoid'$"):
        phase_kind(load_recipe("demo_kto", ["train.kto.loss=sigmoid"]))
