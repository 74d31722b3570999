"""One step off-policy GRPO (``rl.rollout.off_policy: 1``, rl/schedule.py): step k updates on the
batch the policy of step k-1 sampled, the sampling of step k+1 overlapped with step k's update;
staleness in the metrics; the next batch's rollouts saved for an exact resume."""

from __future__ import annotations

import json

import pytest

from tests.rl_factory import make_rl_prompts, rl_overrides
from tests.test_rl_train import kill_after_step_then_resume, run_rl
from tests.train_factory import read_metrics

SAME = ("reward_mean", "loss", "grad_norm", "response_len_mean", "rollout/kl", "rollout/is_mean", "rollout/is_max")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return make_rl_prompts(tmp_path_factory.mktemp("rl_prompts"))


def _train(prompts, out, **kw):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    result = train_rl(load_recipe("demo_grpo", rl_overrides(prompts, out, **kw)))
    return result, read_metrics(out)


def test_off_policy_updates_on_the_previous_policys_samples_overlapped_or_not(prompts, tmp_path):
    """The overlapped run (sampling in a thread during the update) is the sequential one, bit for
    bit; staleness is 0 on the first step and 1 after; and the auto correction is token_tis."""
    _, seq = _train(prompts, tmp_path / "seq", steps=4, rl__rollout__off_policy=1, rl__rollout__overlap=False)
    _, over = _train(prompts, tmp_path / "over", steps=4, rl__rollout__off_policy=1)
    assert [r["rollout/staleness"] for r in over] == [0, 1, 1, 1]
    for key in SAME:
        assert [r[key] for r in over] == [r[key] for r in seq], key
    assert all(r["rollout_wait_s"] >= 0 for r in over) and "rollout/is_clip_frac" in over[-1]
    # the importance weights see the step-old behaviour policy: ~1 at staleness 0, away from 1 after
    assert abs(over[0]["rollout/is_mean"] - 1) < 1e-4 and abs(over[0]["rollout/kl"]) < 1e-5
    assert max(abs(r["rollout/kl"]) for r in over[1:]) > 1e-4


def test_off_policy_samples_batch_k_plus_1_with_the_same_seed_as_on_policy(prompts, tmp_path):
    """With a learning rate of 0 the policy never changes, so the one-step-old samples are the
    on-policy ones: every step's batch and seeds line up with the on-policy run."""
    _, on = _train(prompts, tmp_path / "on", steps=3, train__lr=0.0)
    _, off = _train(prompts, tmp_path / "off", steps=3, train__lr=0.0, rl__rollout__off_policy=1,
                    rl__rollout__correction="none")
    for key in ("reward_mean", "response_len_mean", "loss", "entropy"):
        assert [r[key] for r in off] == [r[key] for r in on], key
    # with learning, step 1 is the same batch from the same weights; step 2 differs (θ_0 vs θ_1 sampled it)
    _, on = _train(prompts, tmp_path / "on2", steps=2)
    _, off = _train(prompts, tmp_path / "off2", steps=2, rl__rollout__off_policy=1, rl__rollout__correction="none")
    assert off[0]["reward_mean"] == on[0]["reward_mean"] and off[0]["loss"] == on[0]["loss"]
    assert off[1]["response_len_mean"] != on[1]["response_len_mean"] or off[1]["reward_mean"] != on[1]["reward_mean"]


def test_off_policy_checkpoint_holds_the_next_batch_and_resumes_exactly_after_sigkill(prompts, tmp_path):
    steps, save = 6, 2
    ov = lambda run: rl_overrides(prompts, run, steps=steps, train__save_interval=save,  # noqa: E731
                                  train__keep_last=0, rl__rollout__off_policy=1)
    ref = run_rl(*ov(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "one step off-policy (rollouts overlapped with updates)" in ref.stdout
    state = json.loads((tmp_path / "ref/checkpoints/step_000002/trainer_state.json").read_text())
    ahead = state["rollouts_ahead"]["0"]
    assert ahead["step"] == 2 and ahead["version"] == 1 and len(ahead["rollouts"]) == 4 * 4
    last = json.loads((tmp_path / f"ref/checkpoints/step_{steps:06d}/trainer_state.json").read_text())
    assert "rollouts_ahead" not in last  # nothing ahead of the last step
    run = tmp_path / "run"
    res = kill_after_step_then_resume(ov(run), run, save + 1)
    assert "sampled again" not in res.stdout
    got, want = read_metrics(run), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for key in (*SAME, "rollout/staleness"):
        assert [r[key] for r in got] == [r[key] for r in want], key  # bit-identical


def test_off_policy_at_dp2_gathers_every_ranks_rollouts(prompts, tmp_path):
    ov = rl_overrides(prompts, tmp_path / "run", steps=2, train__save_interval=1, train__keep_last=0,
                      rl__rollout__off_policy=1)
    res = run_rl(*ov, "--nproc", "2", timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    state = json.loads((tmp_path / "run/checkpoints/step_000001/trainer_state.json").read_text())
    ranks = state["rollouts_ahead"]
    assert sorted(ranks) == ["0", "1"] and ranks["0"]["uids"] != ranks["1"]["uids"]
    assert [r["rollout/staleness"] for r in read_metrics(tmp_path / "run")] == [0, 1]


@pytest.mark.parametrize("override, message", [
    ("rl.rollout.off_policy=2", "rl.rollout.off_policy must be 0 (on-policy) or 1"),
])
def test_bad_off_policy_is_one_line(prompts, tmp_path, override, message):
    r = run_rl(f"data.path={prompts}", f"output_dir={tmp_path / 'run'}", override)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
