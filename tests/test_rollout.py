"""Rollouts (omniweave/generation.py) on the tiny demo model and real demo prompts, fp32:

- shared encoding + one prefill per group (``TorchRollout``) give the same tokens and log-probs
  as re-encoding and re-prefilling every sample alone (``NaiveRollout``), same seeds;
- the rollout log-probs equal the log-probs recomputed on packed prompt+response rows by the
  training forward (``model.hidden`` -> logits / T);
- a sample's tokens depend only on (seed, prompt uid, sample index), not on which prompts share
  the batch; greedy tokens are the argmax of the training forward over prompt + response; stop
  tokens end a sample and are kept.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniweave.generation import NaiveRollout, SamplingParams, TorchRollout, pack_prompts
from tests.rl_factory import demo_model, demo_prompts, raise_stop_logits, stop_ids, stop_where_hidden_is_high

LOGP_ATOL = 1e-5  # |Δ log-prob| (fp32; measured ≤ 1e-6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Random weights, with the stop token's logit raised so that samples end at different steps
    (which exercises the shrinking active set and groups with only some samples left)."""
    model, processor = demo_model()
    prompts = demo_prompts(tmp_path_factory.mktemp("rl_demo"), processor)
    raise_stop_logits(model, processor)
    return model, processor, prompts


def _by_key(rollouts):
    return {(r.uid, r.sample): r for r in rollouts}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=7),
    SamplingParams(temperature=0.9, top_k=600, top_p=0.95, max_new_tokens=6),
], ids=["t1", "topk_topp"])
def test_shared_prefill_equals_reencoding_every_sample(setup, params):
    model, processor, prompts = setup
    params = SamplingParams(**{**params.__dict__, "stop_ids": stop_ids(processor)})
    fast = _by_key(TorchRollout(model).generate(prompts, 4, params, seed=11))
    slow = _by_key(NaiveRollout(model).generate(prompts, 4, params, seed=11))
    assert fast.keys() == slow.keys() and len(fast) == 4 * len(prompts)
    for key, a in fast.items():
        b = slow[key]
        assert a.tokens == b.tokens, key
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGP_ATOL
        assert a.truncated == b.truncated
    assert len({tuple(r.tokens) for r in fast.values()}) > len(prompts)  # samples of a group differ
    lengths = {len(r.tokens) for r in fast.values()}
    assert len(lengths) > 2 and any(not r.truncated for r in fast.values())  # they stop at different steps


def _with_response(prompt: dict, tokens: list[int]) -> dict:
    """A prompt's batch with ``tokens`` appended (positions continue at max(prompt positions) + 1)."""
    nxt = int(prompt["position_ids"].max()) + 1
    return {**prompt, "input_ids": torch.cat([prompt["input_ids"], torch.tensor(tokens)]),
            "position_ids": torch.cat([prompt["position_ids"], (nxt + torch.arange(len(tokens))).expand(3, -1)], -1)}


def test_rollout_logprobs_equal_the_packed_training_forward(setup):
    model, processor, prompts = setup
    params = SamplingParams(temperature=0.8, max_new_tokens=6, stop_ids=stop_ids(processor))
    rollouts = TorchRollout(model).generate(prompts, 2, params, seed=3)
    docs, expected = [], []
    for r in rollouts:  # one packed row: prompt + response of every sample, labels on the response
        p = prompts[r.uid - 100].batch
        docs.append(_with_response(p, r.tokens))
        expected.append((p["input_ids"].shape[0], r))
    from omniweave.generation import Prompt

    row = pack_prompts([Prompt(0, d) for d in docs])
    with torch.no_grad():
        logits = model.foundation.logits(model.hidden(row)).float() / params.temperature
    logp = F.log_softmax(logits, -1)
    worst, start = 0.0, 0
    for d, (n, r) in zip(docs, expected):
        rows = start + n - 1 + torch.arange(len(r.tokens))  # the row before each response token predicts it
        got = logp[rows, torch.tensor(r.tokens)]
        worst = max(worst, (got - torch.tensor(r.logprobs)).abs().max().item())
        start += d["input_ids"].shape[0]
    assert worst <= LOGP_ATOL, worst


def test_samples_depend_only_on_seed_uid_and_index(setup):
    model, processor, prompts = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=5, stop_ids=stop_ids(processor))
    engine = TorchRollout(model)
    together = _by_key(engine.generate(prompts, 3, params, seed=5))
    alone = _by_key(engine.generate(prompts[2:4][::-1], 3, params, seed=5))
    for key, r in alone.items():
        assert r.tokens == together[key].tokens
    other_seed = _by_key(engine.generate(prompts, 3, params, seed=6))
    assert any(other_seed[k].tokens != r.tokens for k, r in together.items())


def test_greedy_is_the_argmax_of_the_training_forward_and_stop_tokens_are_kept(setup):
    _, processor, prompts = setup
    model, _ = demo_model()
    stop_where_hidden_is_high(model, processor)  # greedy samples stop at different steps
    stops = stop_ids(processor)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, stop_ids=stops)
    rollouts = TorchRollout(model).generate(prompts, 1, params, seed=0)
    for r in rollouts:  # teacher-forced: the row before each response token must argmax to it
        p = prompts[r.uid - 100].batch
        n, m = p["input_ids"].shape[0], len(r.tokens)
        row = _with_response(p, r.tokens)
        row["cu_seqlens"] = torch.tensor([0, n + m], dtype=torch.int32)
        with torch.no_grad():
            logits = model.foundation.logits(model.hidden(row))
        assert logits[n - 1:n - 1 + m].argmax(-1).tolist() == r.tokens
        assert r.truncated == (r.tokens[-1] not in stops)
        assert len(r.logprobs) == len(r.tokens) <= 6
    assert len({len(r.tokens) for r in rollouts}) > 2 and any(r.truncated for r in rollouts)


def test_bad_sampling_parameters_are_refused(setup):
    model, _, prompts = setup
    with pytest.raises(ValueError, match="bad sampling parameters"):
        TorchRollout(model).generate(prompts, 2, SamplingParams(top_p=0.0), seed=0)


def test_top_k_and_top_p_keep_only_their_tokens_and_logprobs_ignore_them():
    from omniweave.generation import sample_generator, sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gens = [sample_generator(0, 1, j) for j in range(400)]
    draw = lambda **kw: sample_tokens(logits.expand(400, -1), SamplingParams(**kw), gens)  # noqa: E731
    tokens, logp = draw(top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logp, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])  # full softmax
    tokens, _ = draw(top_p=0.7)  # 0.5 + 0.3 reach 0.7: tokens 0 and 1 only
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = draw(top_p=0.85)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, _ = draw(temperature=1.0)
    assert set(tokens.tolist()) == {0, 1, 2, 3} and abs((tokens == 0).float().mean().item() - 0.5) < 0.08
    tokens, logp = draw(temperature=0.0)
    assert tokens.tolist() == [0] * 400 and torch.allclose(logp, torch.log(torch.tensor(0.5)))
