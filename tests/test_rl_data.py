"""RL prompts through convert and pack (data/packing/prompts.py): the answer comes from the ``solution``
column or the last assistant turn, a prompt without one is a counted reject, and the packed
prompt is exactly what generation is given (the conversation minus its answer + the header)."""

from __future__ import annotations

import json

from omniweave.cli import main
from omniweave.data.loading.loader import PackedLoader
from omniweave.data.packing.packed import PackedDataset
from tests.data_factory import png_bytes


def test_prompts_carry_their_answers_and_bad_rows_are_counted(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56))
    rows = [
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
         "images": ["a.png"]},
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"}], "solution": 5},  # no assistant turn
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hello"}],
         "solution": "hi"},  # the solution column wins over the assistant turn
        {"messages": [{"role": "user", "content": "Nothing to check"}, {"role": "assistant", "content": ""}]},
    ]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "convert", "--input", str(tmp_path / "rl.jsonl"), "--output", str(tmp_path / "raw"),
                 "--workers", "1", "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "prompts"),
                 "--recipe", "demo_grpo", "--workers", "1"]) == 0
    stats = json.loads((tmp_path / "prompts/stats.json").read_text())
    assert stats["dropped"] == {"no_reference_answer": 1} and stats["samples_packed"] == 3
    ds = PackedDataset(tmp_path / "prompts")
    assert ds.manifest["kind"] == "prompts" and ds.manifest["algorithm"] == "single"
    answers = [ds[i]["docs"][0]["answer"] for i in range(len(ds))]
    assert answers == ["red", "5", "hi"]
    loader = PackedLoader(tmp_path / "prompts", 3, 0, 1, kind="prompts")
    (batch,) = [next(iter(loader))]
    by_answer = {p["prompt"]["answer"]: p for p in batch}
    from omniweave.data.text.tokenize import SampleProcessor

    tok = SampleProcessor(loader.data_cfg).tokenizer
    text = tok.decode(by_answer["red"]["input_ids"].tolist())
    assert text.endswith("<|im_start|>assistant\n") and "red" not in text  # the answer is not in the prompt
    assert by_answer["red"]["grid_thw"].tolist() == [[1, 4, 4]] and (by_answer["red"]["labels"] == -100).all()
