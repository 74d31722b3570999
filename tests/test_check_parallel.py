"""`omniweave check`'s parallel group on CPU (2 gloo ranks): every layout passes against one
process; a layout that raises, or whose gradients are wrong, fails its own row only; weights left
as ``to_empty`` memory are caught by the meta-init check; one accelerator gives skip rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omniweave.check import parallel

pytestmark = [pytest.mark.dist]

LAYOUTS = ("cp=2 ring, vision split", "cp=2 allgather, vision split", "cp=2 ulysses, vision split",
           "tp=2 foundation + image encoder", "fsdp2 dp=2, meta-device init", "ep=2 experts (qwen3-moe foundation)")


def test_quick_cpu_rows_pass_for_every_layout():
    rows = list(parallel.rows(torch.device("cpu"), quick=True))
    for r in rows:
        print(r)
    assert [r.name for r in rows] == list(LAYOUTS)
    assert all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
    assert all(float(r.value) <= parallel.CPU_LIMIT for r in rows)


def test_a_failing_layout_is_a_failed_row_and_the_others_still_run():
    """A layout whose ranks raise (cp=3 on 2 ranks) fails with the error; the layouts after it run
    in fresh ranks; one whose gradients are wrong (the ``corrupt`` seam) fails with that error."""
    ring, tp = LAYOUTS[0], LAYOUTS[3]
    chosen = [lay for lay in parallel.layouts(2, parallel.recipe().model) if lay.name in (ring, tp)]
    chosen.insert(1, parallel.Layout("cp=3 on 2 ranks", ("parallel.cp=3",)))
    rows = list(parallel.layout_rows(torch.device("cpu"), 2, chosen, corrupt=tp))
    assert [(r.name, r.status) for r in rows] == [(ring, "pass"), ("cp=3 on 2 ranks", "FAIL"), (tp, "FAIL")], rows
    assert rows[1].note.endswith(": ValueError: world size 2 is not divisible by cp*tp = 3"), rows[1]
    assert float(rows[2].value) == pytest.approx(parallel.CORRUPTION, rel=1e-3)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_meta_init_check_catches_weights_that_were_never_initialised(one_rank_group):
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    model_cfg = to_dict(parallel.recipe().model)
    torch.manual_seed(0)
    reference = build_model(model_cfg)
    reference.init_weights()
    init_state = reference.state_dict()
    with torch.device("meta"):
        model = build_model(model_cfg)
    assert any("on the meta device" in p for p in parallel.init_problems(model, init_state))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # to_empty memory that happens to be zeros: finite, never initialised
            p.zero_()
        problems = parallel.init_problems(model, init_state)
        assert "foundation.norm.weight should be 1 everywhere" in problems, problems
        assert any(p.startswith("foundation.embed_tokens.weight: RMS 0 ") for p in problems), problems
        model.foundation.lm_head.weight[3, 5] = float("nan")
        assert "foundation.lm_head.weight is not finite" in parallel.init_problems(model, init_state)
    model.init_weights()  # another random draw than the reference's: still a sound init
    assert parallel.init_problems(model, init_state) == []


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has several GPUs: the rows would run")
def test_one_accelerator_gives_skip_rows():
    rows = list(parallel.rows(torch.device("cuda"), quick=True))
    assert rows and all(r.status == "skip" and r.note.startswith("one device: ") for r in rows)
