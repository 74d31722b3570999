"""Text a user hands us (issue 31, item 11): special tokens typed in a message are rejected unless
``data.special_tokens_in_text: keep``, and a sample whose text alone is certainly over ``max_len``
is never tokenized whole (a 30 MB row cost 4.7 GB at pack before it was dropped)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from tests.data_factory import png_bytes
from tests.fakes_data import make_samples, write_raw

REPO = Path(__file__).resolve().parents[1]


def raw(*messages, images=()) -> RawSample:
    conv = Conversation("s", [Message(r, c) for r, c in messages], images=[n for n, _ in images])
    return RawSample(key="s", conversation=conv, media=dict(images))


def proc(**cfg) -> SampleProcessor:
    return SampleProcessor({"tokenizer": "demo", "max_len": 64, **cfg})


# ---------------------------------------------------------------------------- special tokens


def test_a_typed_special_token_rejects_the_sample_and_names_the_token():
    with pytest.raises(SampleRejected) as err:
        proc().tokenize(raw(("user", "say <|im_end|> then stop"), ("assistant", "ok")))
    assert err.value.reason == "special_token_in_text"
    assert "user text holds '<|im_end|>'" in str(err.value) and "special_tokens_in_text=keep" in str(err.value)
    with pytest.raises(SampleRejected, match="special_token_in_text"):  # prompts (RL, DPO, eval) too
        proc().tokenize_prompt(raw(("user", "hi"), ("assistant", "<|im_start|>system"), ("user", "q")))


def test_keep_lets_the_control_token_through():
    p = proc(special_tokens_in_text="keep")
    sample = p.tokenize(raw(("user", "say <|im_end|> then stop"), ("assistant", "ok")))
    im_end = p.tokenizer.token_id("<|im_end|>")
    plain = p.tokenize(raw(("user", "say then stop"), ("assistant", "ok")))
    assert int((sample.input_ids == im_end).sum()) == int((plain.input_ids == im_end).sum()) + 1
    # a typed media pad is still caught, by the pad count
    with pytest.raises(SampleRejected, match="placeholder_mismatch"):
        p.tokenize(raw(("user", "<|image_pad|> <image>"), ("assistant", "x"), images=[("a.png", png_bytes(56, 56))]))


def test_plain_text_that_only_looks_special_passes():
    sample = proc().tokenize(raw(("user", "<|im_end| is not a token, nor <im_end|> or <image_pad>"), ("assistant", "ok")))
    assert len(sample) > 10


def test_the_setting_is_part_of_the_fingerprint_and_checked():
    assert proc().fingerprint()["special_tokens_in_text"] == "reject"
    assert proc(special_tokens_in_text="keep").fingerprint() != proc().fingerprint()
    with pytest.raises(ValueError, match="special_tokens_in_text='escape'; choose one of"):
        proc(special_tokens_in_text="escape")


# ---------------------------------------------------------------------------- bounded text


class CountingTokenizer:
    """Records the length of every text the processor tokenizes."""

    def __init__(self, p: SampleProcessor, monkeypatch):
        self.lengths = []
        inner = p.tokenizer.encode_with_offsets

        def encode(text):
            self.lengths.append(len(text))
            return inner(text)

        monkeypatch.setattr(p.tokenizer, "encode_with_offsets", encode)


def test_text_certainly_over_max_len_is_rejected_without_tokenizing(monkeypatch):
    p = proc()
    spy = CountingTokenizer(p, monkeypatch)
    huge = "word " * 200_000  # 1 MB: at least 1e6 // max_token_chars tokens > 64
    assert len(huge) // p.tokenizer.max_token_chars > p.max_len
    with pytest.raises(SampleRejected) as err:
        p.tokenize(raw(("user", "q"), ("assistant", huge)))
    assert err.value.reason == "too_long" and spy.lengths == []
    with pytest.raises(SampleRejected, match="too_long"):
        p.tokenize_prompt(raw(("user", huge), ("assistant", "a")), bounded=True)
    assert spy.lengths == []


def test_drop_turns_cuts_before_the_huge_turn_like_the_unbounded_path(monkeypatch):
    """The bounded path keeps what the full tokenization would have kept, tokenizing only the prefix."""
    messages = (("user", "first question"), ("assistant", "first answer"), ("user", "more"),
                ("assistant", "x " * 50_000))
    p = proc(max_len=48, truncation="drop_turns")
    spy = CountingTokenizer(p, monkeypatch)
    bounded = p.tokenize(raw(*messages))
    assert bounded.truncated and max(spy.lengths) < 200
    unbounded = proc(max_len=48, truncation="drop_turns")
    monkeypatch.setattr(type(unbounded.tokenizer), "max_token_chars", 10**9)  # the bound never triggers
    full = unbounded.tokenize(raw(*messages))
    assert np.array_equal(bounded.input_ids, full.input_ids) and np.array_equal(bounded.labels, full.labels)


def test_a_30mb_row_packs_in_bounded_memory(tmp_path):
    """Measured in a child process: the pack of a raw dataset holding one 30 MB answer (and one typed
    special token) drops both with their reasons, and its peak RSS stays far below the 4.7 GB the
    unbounded tokenization took. Measured 340-370 MB run alone; 1.66 GB once inside a loaded CI run
    (not understood yet), hence the limit of 2.5 GB."""
    samples = make_samples(n_text=6, n_image=2, n_video=0, rejects=False)
    samples.append((Conversation("huge", [Message("user", "q"), Message("assistant", "ab " * 10_000_000)]), {}))
    samples.append((Conversation("typed", [Message("user", "a <|im_start|> b"), Message("assistant", "c")]), {}))
    raw_dir = write_raw(tmp_path / "raw", samples)
    script = textwrap.dedent(f"""
        import json, resource, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.fakes_data import pack_cli
        assert pack_cli({str(raw_dir)!r}, {str(tmp_path / 'packed')!r}) == 0
        print(max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    peak_mb = json.loads(r.stdout.strip().splitlines()[-1]) / 1024
    stats = json.loads((tmp_path / "packed" / "stats.json").read_text())
    assert stats["dropped"] == {"special_token_in_text": 1, "too_long": 1}, stats["dropped"]
    assert stats["samples_packed"] == 8
    print(f"peak RSS of the pack with a 30 MB row: {peak_mb:.0f} MB")
    assert peak_mb < 2500
