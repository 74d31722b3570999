"""``omniweave rl`` end to end on CPU (tiny demo model, demo RL prompts): metrics, bad input,
exact resume after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.rl_factory import make_rl_prompts, rl_overrides
from tests.train_factory import REPO, child_env, read_metrics

METRIC_KEYS = {"step", "loss", "reward_mean", "reward_std", "accuracy", "response_len_mean", "response_clip_frac",
               "kl", "clip_frac", "entropy", "frac_zero_std", "rollout_s", "update_s", "tokens_per_s",
               "grad_norm", "lr"}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return make_rl_prompts(tmp_path_factory.mktemp("rl_prompts"))


def rl_cmd(*args):
    return [sys.executable, "-m", "omniweave", "rl", "demo_grpo", *map(str, args)]


def run_rl(*args, timeout=300, env=None):
    return subprocess.run(rl_cmd(*args), capture_output=True, text=True, env=env or child_env(), cwd=REPO,
                          timeout=timeout)


def test_a_grpo_run_logs_every_metric_and_checkpoints(prompts, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    overrides = rl_overrides(prompts, tmp_path / "run", steps=3, rl__kl_coef=0.05, rl__ppo_epochs=1,
                             train__save_interval=2, train__keep_last=0)
    cfg = load_recipe("demo_grpo", overrides)
    result = train_rl(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and result["steps"] == 3
    for r in rows:
        assert METRIC_KEYS <= set(r) and "reward/tests.rl_user_rewards:vowel_fraction" in r, sorted(r)
        assert 0 < r["reward_mean"] < 1 and r["reward_std"] > 0 and r["samples"] == 16
        assert r["frac_zero_std"] == 0 and r["response_len_mean"] <= 5
    assert rows[0]["kl"] == 0.0  # the policy starts as the reference (one update per step: measured before it)
    assert rows[-1]["kl"] > 0  # … and moves away from it
    assert (tmp_path / "run/checkpoints/step_000002").is_dir() and (tmp_path / "run/checkpoints/step_000003").is_dir()


@pytest.mark.parametrize("override, message", [
    ("rl.rewards=[{name: exact_mach}]", "unknown reward 'exact_mach'"),
    ("rl.clip_low=1.5", "rl.clip_low must be in (0, 1)"),
    ("rl.group_size=1", "rl.group_size must be >= 2"),
])
def test_bad_rl_settings_are_one_line(prompts, tmp_path, override, message):
    r = run_rl(f"data.path={prompts}", f"output_dir={tmp_path / 'run'}", override)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


def test_sft_packs_are_refused_by_rl_and_prompts_by_train(prompts, demo_packed, tmp_path):
    r = run_rl(f"data.path={demo_packed}", f"output_dir={tmp_path / 'a'}")
    assert r.returncode == 2 and "holds training packs" in r.stderr
    r = subprocess.run([sys.executable, "-m", "omniweave", "train", "demo", f"data.path={prompts}",
                        f"output_dir={tmp_path / 'b'}"], capture_output=True, text=True, env=child_env(), cwd=REPO)
    assert r.returncode == 2 and "holds RL prompts" in r.stderr


def test_a_reward_that_raises_drops_and_counts_its_groups(prompts, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    rewards = "[{name: 'tests.rl_user_rewards:vowel_fraction'}, {name: 'tests.rl_user_rewards:raises_on_e'}]"
    train_rl(load_recipe("demo_grpo", rl_overrides(prompts, tmp_path / "run", steps=2, rl__rewards=rewards)))
    rows = read_metrics(tmp_path / "run")
    assert sum(r["groups_failed"] for r in rows) > 0  # counted, never a silent zero
    assert all(r["groups_failed"] <= 4 for r in rows)


def _wait_for_step(run, step, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_metrics(run)
        if rows and rows[-1]["step"] >= step:
            return
        assert proc.poll() is None, f"the run exited (rc {proc.returncode}) before step {step}"
        time.sleep(0.02)
    raise AssertionError(f"no step {step} in {timeout} s")


def kill_after_step_then_resume(overrides: list[str], run, step: int) -> subprocess.CompletedProcess:
    """``omniweave rl`` killed with SIGKILL once it has logged ``step``, then ``--resume auto``d to the end."""
    proc = subprocess.Popen(rl_cmd(*overrides), env=child_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for_step(run, step, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    res = run_rl(*overrides, "--resume", "auto")
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-3000:]
    return res


def test_sigkill_then_resume_gives_the_uninterrupted_run(prompts, tmp_path):
    steps, save = 6, 2
    ov = lambda run: rl_overrides(prompts, run, steps=steps, train__save_interval=save, train__keep_last=0)  # noqa: E731
    ref = run_rl(*ov(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "run"
    kill_after_step_then_resume(ov(run), run, save + 1)
    got, want = read_metrics(run), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for key in ("reward_mean", "loss", "grad_norm", "response_len_mean"):
        assert [r[key] for r in got] == [r[key] for r in want], key  # bit-identical


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_several_updates_per_step_and_every_aggregation(prompts, tmp_path, agg):
    """ppo_epochs x mini_batches optimizer steps per GRPO step (counted through the optimizer)."""
    import torch

    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    steps = []
    original = torch.optim.AdamW.step

    def counting_step(self, *a, **kw):
        steps.append(1)
        return original(self, *a, **kw)

    torch.optim.AdamW.step = counting_step
    try:
        train_rl(load_recipe("demo_grpo", rl_overrides(prompts, tmp_path / "run", steps=2, rl__ppo_epochs=2,
                                                       rl__mini_batches=2, rl__loss_agg=agg)))
    finally:
        torch.optim.AdamW.step = original
    rows = read_metrics(tmp_path / "run")
    assert len(steps) == 2 * 2 * 2 and [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["loss"]) < 10 and r["grad_norm"] > 0 for r in rows)


def test_grpo_trains_lora_adapters_only(prompts, tmp_path):
    """``omniweave rl`` with LoRA on the foundation (the vision tower and projector frozen): the
    rollouts sample from the adapted policy, the update moves the adapters and nothing else, and the
    KL to the reference (the initial policy) starts at 0 and grows."""
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl
    from tests.train_factory import final_state

    overrides = rl_overrides(prompts, tmp_path / "run", steps=3, rl__kl_coef=0.05, rl__ppo_epochs=1,
                             train__save_interval=1, train__keep_last=0, train__lr=0.01,
                             model__image_encoder__freeze=True, model__projector__freeze=True)
    cfg = load_recipe("demo_grpo", [*overrides, "+model.foundation.lora={r: 4, alpha: 8, targets: all-linear}"])
    train_rl(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0
    first, last = (final_state(tmp_path / f"run/checkpoints/step_{s:06d}") for s in (1, 3))
    adapters = [k for k in last if ".lora_" in k]
    assert adapters and all(not torch.equal(first[k], last[k]) for k in adapters if ".lora_B" in k)
    assert all(torch.equal(first[k], last[k]) for k in last if ".lora_" not in k)  # base and frozen parts stay
