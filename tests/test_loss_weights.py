"""Fractional per-turn loss weights (issue 32, item 4): a turn's ``loss_weight`` w scales its tokens'
losses — kept as runs on the tokenized sample, written into the pack's document records over the
shifted labels, read back as ``token_data["loss_weight"]``, and applied by the model's loss — on
packed rows against a hand-built expectation. The layouts (dp, cp, pp, seq_chunks) are in
tests/dist/test_loss_weights_dist.py."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from omniweave.data.sample import RawSample
from omniweave.data.sources.formats import parse_row
from omniweave.data.sources.mapping import Mapping
from omniweave.data.text.template import IGNORE_INDEX
from omniweave.data.text.tokenize import SampleProcessor
from tests.fakes_data import DATA_CFG, build_packed

Q1, A1, Q2, A2 = "What is two plus two?", "four, said the oracle", "And three plus three?", "six"


def weighted_row(w: float, answer2_weight: float = 1.0) -> dict:
    return {"messages": [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1, "loss_weight": w},
                         {"role": "user", "content": Q2},
                         {"role": "assistant", "content": A2, "loss_weight": answer2_weight}]}


def first_answer_tokens(proc: SampleProcessor) -> tuple[int, int]:
    """The unshifted token range [n1, n2) of the first answer (its text and closing ``<|im_end|>\\n``),
    from the ChatML text up to it, tokenized by hand."""
    prefix = (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n"
              "<|im_start|>assistant\n")
    n1 = len(proc.tokenizer.encode(prefix))
    n2 = len(proc.tokenizer.encode(prefix + A1 + "<|im_end|>\n"))
    return n1, n2


def test_a_fractional_weight_is_a_run_over_its_turns_loss_tokens_only():
    proc = SampleProcessor({"tokenizer": "demo"})
    sample = proc.tokenize(RawSample("s", parse_row(weighted_row(0.25), Mapping().resolved("openai"), row_id="r"), {}))
    n1, n2 = first_answer_tokens(proc)
    assert sample.loss_weights == [(n1, n2, 0.25)]
    plain = proc.tokenize(RawSample("s", parse_row(weighted_row(1.0), Mapping().resolved("openai"), row_id="r"), {}))
    assert plain.loss_weights is None and plain.labels.tolist() == sample.labels.tolist()  # labels unchanged
    two = proc.tokenize(RawSample("s", parse_row(weighted_row(0.5, 2.0), Mapping().resolved("openai"), row_id="r"), {}))
    assert two.loss_weights[0] == (n1, n2, 0.5) and two.loss_weights[1][2] == 2.0
    assert two.loss_weights[1][1] == len(two)  # the second answer runs to the end of the sample


def _packed_weighted(tmp_path, weights=(0.25, 1.0, 0.5, 0.0, 3.0)):
    samples = [(parse_row(weighted_row(w), Mapping().resolved("openai"), row_id=f"r{i}"), {}) for i, w in enumerate(weights)]
    _, packed = build_packed(tmp_path, samples=samples)
    return packed


def test_weights_travel_through_packing_to_the_micro_batch(tmp_path):
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    packed = _packed_weighted(tmp_path)
    proc = SampleProcessor(DATA_CFG)
    n1, n2 = first_answer_tokens(proc)
    seen = {}
    for pack in PackedDataset(packed):
        batch = collate_pack(pack, DATA_CFG)
        want = torch.ones(batch["labels"].shape[0])
        for start, doc in zip(pack["cu_seqlens"][:-1].tolist(), pack["docs"]):
            w = [0.25, 1.0, 0.5, 0.0, 3.0][int(doc["id"][1:])]
            seen[doc["id"]] = doc.get("loss_weights")
            if w not in (0.0, 1.0):  # shifted labels: label i predicts token i + 1
                want[start + n1 - 1 : start + n2 - 1] = w
        got = (batch.get("token_data") or {}).get("loss_weight")
        if torch.equal(want, torch.ones_like(want)):
            assert got is None  # packs without fractional turns stay as they were
        else:
            assert torch.equal(got, want)
    assert seen["r1"] is None and seen["r3"] is None and seen["r0"] == [[n1 - 1, n2 - 1, 0.25]]


def test_the_loss_is_the_weighted_sum_of_token_losses(tmp_path):
    """model(batch).loss_sum == Σ w_i · CE_i over the labelled tokens, CE from the model's own logits."""
    from omniweave.config import load_recipe
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from omniweave.models.registry import build_model

    packed = _packed_weighted(tmp_path)
    torch.manual_seed(0)
    model = build_model(load_recipe("demo").model)
    checked = 0
    for pack in PackedDataset(packed):
        batch = collate_pack(pack, DATA_CFG)
        weights = (batch.get("token_data") or {}).get("loss_weight")
        if weights is None:
            continue
        out = model(batch)
        ce = F.cross_entropy(model.logits(batch).float(), batch["labels"], ignore_index=IGNORE_INDEX, reduction="none")
        assert torch.allclose(out.loss_sum, (ce * weights).sum(), rtol=1e-5, atol=1e-6)
        assert int(out.num_tokens) == int((batch["labels"] != IGNORE_INDEX).sum())  # the normaliser counts tokens
        unweighted = model({k: v for k, v in batch.items() if k != "token_data"}).loss_sum
        assert not torch.allclose(out.loss_sum, unweighted)
        checked += 1
    assert checked


def test_pretraining_drops_the_weights_and_chunks_cut_them_like_labels():
    from omniweave.parallel.seq_chunks import ChunkPlan, chunk_batch
    from omniweave.train.loss import apply_phase

    batch = {"input_ids": torch.arange(8), "labels": torch.arange(8), "cu_seqlens": torch.tensor([0, 8]),
             "token_data": {"loss_weight": torch.linspace(0, 1, 8)}, "num_loss_tokens": 8}
    assert "token_data" not in apply_phase([batch], "pretrain", ())[0]
    plan = ChunkPlan(start=2, end=6, key_start=0, cu_q=(0, 4), cu_k=(0, 6))
    chunk = chunk_batch(batch, plan, {})
    assert torch.equal(chunk["token_data"]["loss_weight"], batch["token_data"]["loss_weight"][2:6])
    assert np.allclose(chunk["labels"].numpy(), np.arange(2, 6))
