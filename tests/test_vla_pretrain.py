"""The VLA demo's vision pretraining (vla/pretrain.py): its labels are where the discs are drawn,
its batches go through the recipe's own image processing, and a short run exports a backbone
directory that a VLA run initialises from."""

from __future__ import annotations

import numpy as np
import pytest

from omniweave.vla.pretrain import pretrain_vision, scene, slot_of
from omniweave.vla.sim import COLOURS, RING_RADIUS, RING_SLOTS


@pytest.mark.parametrize("slot", range(RING_SLOTS))
def test_slot_of_a_ring_point_is_its_slot(slot):
    angle = 2 * np.pi * slot / RING_SLOTS
    assert slot_of(0.5 + RING_RADIUS * np.array([np.cos(angle), np.sin(angle)])) == slot


def test_scene_labels_are_where_the_discs_are_drawn():
    """The slot of each colour's drawn pixels (their centroid, image rows = y) is its label."""
    for seed in range(20):
        image, slots = scene(seed, 56, moves=seed % 5)
        for colour, slot in zip(COLOURS, slots):
            rows, cols = np.nonzero(np.abs(image.astype(int) - COLOURS[colour]).sum(-1) < 30)
            centre = np.array([cols.mean() + 0.5, rows.mean() + 0.5]) / 56
            assert slot_of(centre) == slot


def test_a_short_pretraining_exports_a_backbone(tmp_path):
    hf, accuracy = pretrain_vision(tmp_path, "demo", steps=2, batch=4, eval_scenes=8)
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert 0.0 <= accuracy <= 1.0
