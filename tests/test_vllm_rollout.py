"""The vLLM rollout engine (omniweave/rl/vllm_engine.py) against the native engine and the
training forward, on the head-dim-32 demo model (recipe demo_vllm) and real demo prompts
(images, a video, text only), fp32 on the CPU. Runs in the vLLM venv (``make venv-vllm``,
.ci/vllm_env.sh); skipped where vLLM is not installed.

- greedy rollouts equal the native engine's tokens, stop tokens included; log-probs within
  LOGP_ATOL except on the video (see test_video_positions_follow_vllms_rule);
- sampled rollouts depend only on (seed, prompt uid, sample), not on the batch;
- cached vision features (image_embeds from our tower) give the prompt log-probs vLLM gets when it
  encodes the pixels itself;
- after a weight sync the engine's log-probs equal the training forward on the new weights.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from omniweave.config import load_recipe, to_dict  # noqa: E402
from omniweave.data.text.tokenize import SampleProcessor  # noqa: E402
from omniweave.generation import Prompt, SamplingParams, TorchRollout, pack_prompts  # noqa: E402
from omniweave.models.registry import build_model  # noqa: E402
from tests.rl_factory import demo_prompts, stop_ids  # noqa: E402

pytestmark = pytest.mark.vllm
LOGP_ATOL = 1e-4  # |Δ log-prob|, fp32 (measured ≤ 5e-7 on images and text)
OPTIONS = {"gpu_memory_utilization": 0.05, "enforce_eager": True, "sleep": False, "max_images": 4, "max_videos": 2}
VIDEO_UID = 101  # the one video question among the first seven


def _model(seed: int = 0):
    cfg = load_recipe("demo_vllm")
    torch.manual_seed(seed)
    model = build_model(to_dict(cfg.model)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return cfg, model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from omniweave.rl.vllm_engine import VLLMRollout

    cfg, model = _model()
    processor = SampleProcessor(cfg.data)
    root = tmp_path_factory.mktemp("vllm_demo")
    prompts = demo_prompts(root, processor)
    engine = VLLMRollout(model, cfg, root / "engine", OPTIONS, max_model_len=1024)
    engine.sync()
    yield cfg, model, processor, prompts, engine, root
    engine.close()  # its memory and process group freed for the next module's engines


def _by_key(rollouts):
    return {(r.uid, r.sample): r for r in rollouts}


def _forward_logprobs(model, prompts, rollouts, temperature: float) -> dict:
    """Per rollout, the training forward's log-probs of its tokens (prompt + response packed)."""
    docs, spans = [], []
    for r in rollouts:
        p = next(q for q in prompts if q.uid == r.uid).batch
        nxt = int(p["position_ids"].max()) + 1
        docs.append({**p, "input_ids": torch.cat([p["input_ids"], torch.tensor(r.tokens)]),
                     "position_ids": torch.cat([p["position_ids"], (nxt + torch.arange(len(r.tokens))).expand(3, -1)], -1)})
        spans.append(p["input_ids"].shape[0])
    row = pack_prompts([Prompt(0, d) for d in docs])
    with torch.no_grad():
        logp = F.log_softmax(model.foundation.logits(model.hidden(row)).float() / temperature, -1)
    out, start = {}, 0
    for d, n, r in zip(docs, spans, rollouts):
        rows = start + n - 1 + torch.arange(len(r.tokens))
        out[(r.uid, r.sample)] = logp[rows, torch.tensor(r.tokens)]
        start += d["input_ids"].shape[0]
    return out


def test_greedy_rollouts_equal_the_native_engine(setup):
    cfg, model, processor, prompts, engine, _ = setup
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_ids=stop_ids(processor))
    native = TorchRollout(model).generate(prompts, 2, params, seed=0)
    # a stop token the model reaches: the third greedy token of the first prompt
    stop = native[0].tokens[2]
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_ids=(*stop_ids(processor), stop))
    native = _by_key(TorchRollout(model).generate(prompts, 2, params, seed=0))
    theirs = _by_key(engine.generate(prompts, 2, params, seed=0))
    assert native.keys() == theirs.keys() and len(theirs) == 2 * len(prompts)
    for key, a in native.items():
        b = theirs[key]
        assert a.tokens == b.tokens and a.truncated == b.truncated, key
        if key[0] != VIDEO_UID:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGP_ATOL, key
    stopped = [r for r in theirs.values() if not r.truncated]
    assert stopped and all(r.tokens[-1] in params.stop_ids for r in stopped)  # the stop token is kept


def test_sampled_rollouts_depend_only_on_seed_uid_and_sample(setup):
    _, _, processor, prompts, engine, _ = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=stop_ids(processor))
    first = _by_key(engine.generate(prompts, 4, params, seed=3))
    again = _by_key(engine.generate(prompts[::-1][:4], 4, params, seed=3))  # other batch, other order
    assert all(first[k].tokens == r.tokens for k, r in again.items())
    assert len({tuple(r.tokens) for r in first.values()}) > len(prompts)  # a group's samples differ
    other = _by_key(engine.generate(prompts, 4, params, seed=4))
    assert any(other[k].tokens != r.tokens for k, r in first.items())


def _prompt_logprobs(engine, prompt: dict) -> tuple[list[int], torch.Tensor]:
    from vllm import SamplingParams as VSampling
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate([TokensPrompt(**prompt)], VSampling(max_tokens=1, prompt_logprobs=0, temperature=0,
                                                                  detokenize=False), use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    return ids, torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])


def test_cached_features_equal_vllm_encoding_the_pixels(setup):
    """Image prompts: our tower's features as image_embeds vs the image itself through vLLM's
    processor and tower (the same weights, synced)."""
    import json

    from PIL import Image

    _, _, _, prompts, engine, root = setup
    rows = [json.loads(line) for line in (root / "eval.jsonl").read_text().splitlines()][: len(prompts)]
    media = engine.media_inputs(prompts)
    checked = 0
    for p, m, row in zip(prompts, media, rows):
        if not row["images"]:
            continue
        cached = engine.engine_prompt(p, m)
        pixels = {"prompt_token_ids": cached["prompt_token_ids"],
                  "multi_modal_data": {"image": [Image.open(root / "media" / f).convert("RGB") for f in row["images"]]}}
        ids_a, a = _prompt_logprobs(engine, cached)
        ids_b, b = _prompt_logprobs(engine, pixels)
        assert ids_a == ids_b == p.batch["input_ids"].tolist()  # both expanded back to our placeholders
        assert (a - b).abs().max().item() <= LOGP_ATOL, p.uid
        checked += 1
    assert checked >= 3


def test_after_a_sync_the_engine_logprobs_equal_the_training_forward(setup):
    cfg, model, processor, prompts, engine, _ = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=stop_ids(processor))
    text_and_images = [p for p in prompts if p.uid != VIDEO_UID]
    before = _by_key(engine.generate(text_and_images, 2, params, seed=5))
    _, new = _model(seed=1)  # other weights, synced through the rollout copy
    model.load_state_dict(new.state_dict())
    try:
        engine.sync()
        after = engine.generate(text_and_images, 2, params, seed=5)
        expected = _forward_logprobs(model, prompts, after, params.temperature)
        worst = max((torch.tensor(r.logprobs) - expected[(r.uid, r.sample)]).abs().max().item() for r in after)
        assert worst <= LOGP_ATOL, worst
        assert any(before[(r.uid, r.sample)].tokens != r.tokens for r in after)  # the engine samples the new weights
    finally:
        _, old = _model(seed=0)
        model.load_state_dict(old.state_dict())
        engine.sync()


def test_video_positions_follow_vllms_rule(setup):
    """vLLM 0.32 continues the text after a video at the block's max position + 1 (transformers
    4.x's rule); transformers 5, and so our data, at start + max(h, w) (data/text/rope_index.py).
    They differ for a video whose temporal extent exceeds its spatial one, as the demo's (2
    temporal patches 2 apart on a 2x2 grid): with vLLM's positions our forward equals vLLM's
    prompt log-probs; with ours the text after the video differs. The correction
    (rl.rollout.correction) absorbs this gap in training."""
    _, model, _, prompts, engine, _ = setup
    p = next(q for q in prompts if q.uid == VIDEO_UID)
    ids, theirs = _prompt_logprobs(engine, engine.engine_prompt(p, engine.media_inputs([p])[0]))
    batch = p.batch
    pos = batch["position_ids"].clone()
    start, length = batch["media_spans"].reshape(-1, 2)[0].tolist()
    end = start + length
    pos[:, end:] += int(pos[:, start:end].max()) + 1 - int(pos[0, end])  # max + 1
    n = batch["input_ids"].shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32)

    def forward(position_ids):
        with torch.no_grad():
            h = model.hidden({**batch, "position_ids": position_ids, "cu_seqlens": cu})
        logp = F.log_softmax(model.foundation.logits(h).float(), -1)
        return logp[:-1].gather(1, batch["input_ids"][1:, None])[:, 0]

    assert ids == batch["input_ids"].tolist()
    assert (forward(pos) - theirs).abs().max().item() <= LOGP_ATOL
    assert (forward(batch["position_ids"]) - theirs)[end - 1 :].abs().max().item() > LOGP_ATOL
