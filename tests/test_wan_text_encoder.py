"""WanTextEncoder (omniweave/diffusion/text_encoder.py) against diffusers' WanPipeline text path.

A tiny random umT5 (d_model 32, 2 layers) over the demo tokenizer, wrapped by diffusers'
``WanPipeline`` (tokenizer + text encoder + a tiny VAE, no transformer):

    pad(encode(prompts), L) == pipe._get_t5_prompt_embeds(prompts, max_sequence_length=L)

measured bit-identical (max abs error 0.0) for L = 24 and 512, prompts of different lengths, the
empty prompt (one token: the end-of-sequence), one that needs the pipeline's cleaning (HTML entities,
runs of white space) and one longer than L (truncated to L). ``padding="longest"`` is within 1e-5
(measured 7e-7 to 1.1e-6 on states of |x| up to ~3: summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omniweave.diffusion.text_encoder import WanTextEncoder, pad_states, prompt_clean

diffusers = pytest.importorskip("diffusers")

PROMPTS = ["a cat surfing on a wave", "", "  two dogs &amp;amp; a\n\tcat   on\u00a0grass ", "long " * 300, "hi"]


@pytest.fixture(scope="module")
def enc():
    return WanTextEncoder.tiny()


@pytest.fixture(scope="module")
def pipe(enc):
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                     temperal_downsample=[False, True, True])
    return diffusers.WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.model, vae=vae,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


@pytest.mark.parametrize("length", [24, 512])
def test_matches_the_pipelines_text_states(enc, pipe, length):
    want = pipe._get_t5_prompt_embeds(PROMPTS, max_sequence_length=length)
    states = enc.encode(PROMPTS, max_sequence_length=length)
    got = enc.pad(states, length)
    err = (got - want).abs().max().item()
    print(f"L={length}: lengths {[s.shape[0] for s in states]}, max abs error vs _get_t5_prompt_embeds {err:.1e}")
    assert got.shape == want.shape == (len(PROMPTS), length, enc.dim)
    assert torch.equal(got, want)
    assert states[1].shape[0] == 1  # "" is its end-of-sequence token
    assert states[3].shape[0] == length  # truncated
    assert all(s.shape[0] < length for i, s in enumerate(states) if i != 3)
    assert enc.forward(PROMPTS, length).equal(want)
    longest = enc.pad(enc.encode(PROMPTS, max_sequence_length=length, padding="longest", batch_size=2), length)
    assert (longest - want).abs().max().item() < 1e-5


def test_empty_states_are_the_pipelines_negative_prompt(enc, pipe):
    empty = enc.empty_states()
    assert empty is enc.empty_states()  # cached
    assert torch.equal(empty, enc.encode([""])[0])
    _, negative = pipe.encode_prompt(["a cat", "a dog"], negative_prompt=None, do_classifier_free_guidance=True,
                                     max_sequence_length=512)
    assert torch.equal(negative, enc.pad([empty, empty]))


def test_prompt_clean_is_diffusers(enc):
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as theirs

    for text in PROMPTS + ["\u2003em\u2003space\x1c", "&lt;b&gt;", "tab\tand\r\nnewline "]:
        assert prompt_clean(text) == theirs(text)


def test_frozen_eval_no_grad(enc):
    assert not any(p.requires_grad for p in enc.parameters())
    parent = torch.nn.Sequential(enc)
    parent.train()
    assert not enc.training and not enc.model.training
    out = enc.encode(["a"])[0]
    assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(TypeError, match="list of prompts"):
        enc.encode("a")


def test_from_pretrained_pipeline_root_and_subfolder(enc, pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    want = enc.pad(enc.encode(PROMPTS[:3], max_sequence_length=32), 32)
    for where in ("pipe", "pipe/text_encoder"):
        loaded = WanTextEncoder.from_pretrained(tmp_path / where)
        assert type(loaded.model).__name__ == "UMT5EncoderModel" and loaded.dtype == torch.float32
        assert torch.equal(loaded.pad(loaded.encode(PROMPTS[:3], max_sequence_length=32), 32), want)
    enc.save_pretrained(tmp_path / "own")
    again = WanTextEncoder.from_pretrained(tmp_path / "own", dtype=torch.bfloat16, device="cpu")
    states = again.encode(["a cat"])
    assert states[0].dtype == torch.bfloat16 and again.max_sequence_length == 512
    assert (states[0].float() - enc.encode(["a cat"])[0]).abs().max().item() < 0.1
    with pytest.raises(FileNotFoundError, match="no config.json"):
        WanTextEncoder.from_pretrained(tmp_path)


def test_t5_and_vocabulary_checks():
    t5 = WanTextEncoder.from_config({"model_type": "t5", "d_model": 16, "num_layers": 1, "num_heads": 2, "d_kv": 8,
                                     "d_ff": 32, "dropout_rate": 0.0})  # fmt: skip
    assert type(t5.model).__name__ == "T5EncoderModel"
    assert t5.encode(["x", ""])[1].shape == (1, 16)
    with pytest.raises(ValueError, match="smaller than its tokenizer"):
        WanTextEncoder.from_config({"d_model": 16, "num_layers": 1, "num_heads": 2, "d_kv": 8, "d_ff": 32,
                                    "vocab_size": 100})  # fmt: skip
    with pytest.raises(ValueError, match="umt5 or t5"):
        WanTextEncoder.from_config({"model_type": "bert"})


def test_pad_states():
    a, b = torch.ones(3, 4), torch.full((1, 4), 2.0)
    out = pad_states([a, b], 5)
    assert out.shape == (2, 5, 4) and out[0, 3:].abs().sum() == 0 and out[1, 0, 0] == 2 and out[1, 1:].abs().sum() == 0
    with pytest.raises(ValueError, match="exceed max_len"):
        pad_states([torch.ones(6, 4)], 5)
    with pytest.raises(ValueError, match="one D"):
        pad_states([a, torch.ones(2, 3)], 5)
