"""Generation with Qwen3.5's hybrid layers (issue 34, step 6): a linear-attention layer's cache is
its conv window and recurrent state (O(1) per token), beside the full-attention layers' K/V.

- one sequence (``KVCache``, the reference rollout's cache): greedy tokens equal an argmax loop
  that re-runs the whole sequence every step, and transformers' own ``generate`` on the same weights;
- the rollout engine (``GroupKVCache``: prompts packed in one prefill row, each prompt's state
  copied to its G samples, samples stopping at different steps) equals re-prefilling every sample
  alone (``NaiveRollout``): same tokens, log-probs within 1e-5;
- the one-token decode step of the gated delta rule equals the chunked kernel's next token.
"""

from __future__ import annotations

import pytest
import torch

from omniweave.generation import NaiveRollout, Prompt, SamplingParams, TorchRollout
from omniweave.models.hf.loading import load_hf
from tests.hf_factory import save_tiny

LOGP_ATOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def pair(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    hf = save_tiny(family, path)
    ours, _ = load_hf(path)
    return hf.eval(), ours.eval()


def _prompts(n: int = 3) -> list[Prompt]:
    g = torch.Generator().manual_seed(7)
    return [Prompt(i, {"input_ids": torch.randint(0, 1024, (length,), generator=g)})
            for i, length in enumerate((9, 70, 4)[:n])]  # 70: more than one kernel chunk of 64


def test_greedy_with_the_cache_equals_rerunning_the_sequence_and_transformers(pair):
    hf, ours = pair
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for prompt in _prompts():
        got = NaiveRollout(ours).generate([prompt], 1, params, seed=0)[0].tokens
        ids, want = prompt.batch["input_ids"], []
        with torch.no_grad():
            for _ in range(8):
                tok = int(ours.logits({"input_ids": ids})[-1].argmax())
                want.append(tok)
                ids = torch.cat([ids, torch.tensor([tok])])
        assert got == want
        hf_out = hf.generate(prompt.batch["input_ids"][None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert hf_out[0, prompt.batch["input_ids"].numel():].tolist() == want


def test_shared_prefill_rollouts_equal_every_sample_alone(pair):
    _, ours = pair
    # a high temperature and a frequent stop token: samples of a group differ and stop at different steps
    params = SamplingParams(temperature=1.5, max_new_tokens=7, stop_ids=tuple(range(0, 1024, 9)))
    prompts = _prompts()
    fast = {(r.uid, r.sample): r for r in TorchRollout(ours).generate(prompts, 4, params, seed=3)}
    slow = {(r.uid, r.sample): r for r in NaiveRollout(ours).generate(prompts, 4, params, seed=3)}
    assert fast.keys() == slow.keys()
    for key, a in fast.items():
        assert a.tokens == slow[key].tokens, key
        assert max(abs(x - y) for x, y in zip(a.logprobs, slow[key].logprobs)) <= LOGP_ATOL
    assert len({len(r.tokens) for r in fast.values()}) > 1  # they stopped at different steps


def test_decode_step_equals_the_chunked_kernel():
    from omniweave.models.components.gated_delta import gated_delta_rule_chunked, gated_delta_rule_step

    g = torch.Generator().manual_seed(0)
    L, hk, hv, dk, dv = 11, 2, 4, 6, 5
    q, k = torch.randn(L, hk, dk, generator=g), torch.randn(L, hk, dk, generator=g)
    v, beta = torch.randn(L, hv, dv, generator=g), torch.rand(L, hv, generator=g)
    decay = -torch.rand(L, hv, generator=g)
    cu = torch.tensor([0, L - 1], dtype=torch.int32)
    _, state = gated_delta_rule_chunked(q[:-1], k[:-1], v[:-1], decay[:-1], beta[:-1], cu, chunk_size=4, qk_l2norm=True)
    o, after = gated_delta_rule_step(q[-1:], k[-1:], v[-1:], decay[-1:], beta[-1:], state, qk_l2norm=True)
    whole, final = gated_delta_rule_chunked(q, k, v, decay, beta, torch.tensor([0, L], dtype=torch.int32),
                                            chunk_size=4, qk_l2norm=True)
    torch.testing.assert_close(o, whole[-1:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(after, final, atol=1e-6, rtol=1e-5)
