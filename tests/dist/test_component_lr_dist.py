"""Per-component learning rates under sharded layouts (gloo): with ``model.image_encoder.lr=0``
the tower's weights stay bit-identical under FSDP (dp 2) and through a pipeline (pp 2, the
tower on stage 0) while the LLM trains, and the log carries every group's rate."""

from __future__ import annotations

import pytest

from omniweave.parallel.spawn import run_ranks
from tests.train_factory import final_state, overrides, read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _body(rank: int, world: int, ov: list[str]):
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train

    return train(load_recipe("demo", ov))["steps"]


@pytest.mark.parametrize("layout", [{}, {"parallel__pp": 2}], ids=["dp2", "pp2"])
def test_a_tower_with_lr_0_stays_bit_identical(demo_packed, tmp_path, layout):
    from tests.test_component_lr import _initial, _moved

    from omniweave.config import load_recipe

    ov = overrides(demo_packed, tmp_path / "run", steps=3, train__weight_decay=0.1, train__cpu_threads=1,
                   model__image_encoder__lr=0, **layout)
    init = _initial(load_recipe("demo", ov))
    assert run_ranks(_body, 2, ov, timeout=600) == [3, 3]
    final = final_state(tmp_path / "run")
    assert _moved(final, init, "image_encoder.") == 0.0
    assert _moved(final, init, "foundation.") > 1e-4
    assert all(r["lr/image_encoder"] == 0.0 and r["lr/foundation"] > 0 for r in read_metrics(tmp_path / "run"))
