"""Training phases: pretrain labels are next tokens within each document, never vision pads."""

import pytest
import torch

from omniweave.train.loss import apply_phase, pretrain_labels


def test_pretrain_labels_stay_inside_documents_and_skip_vision_pads():
    ids = torch.tensor([10, 11, 12, 20, 7, 7, 21, 30])  # docs [0,3) [3,7) [7,8); 7 = image pad
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    labels = pretrain_labels(ids, cu, ignore_ids=(7,))
    assert labels.tolist() == [11, 12, -100, -100, -100, 21, -100, -100]


def test_sft_keeps_pack_labels_and_pretrain_recounts_loss_tokens():
    pack = {"input_ids": torch.tensor([1, 2, 3, 4]), "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32),
            "labels": torch.tensor([-100, -100, 4, -100]), "num_loss_tokens": 1}
    assert apply_phase([pack], "sft", ())[0] is pack
    pre = apply_phase([pack], "pretrain", ())[0]
    assert pre["labels"].tolist() == [2, 3, 4, -100] and pre["num_loss_tokens"] == 3


def test_unknown_phase_is_rejected_by_name():
    with pytest.raises(ValueError, match="train.phase='ppo'"):  # dpo is a phase now (train/dpo.py)
        apply_phase([], "ppo", ())
