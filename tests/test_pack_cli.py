"""`omniweave data pack`: restart skips finished phases, machine slices equal one run, build checks."""

import json
import math

import numpy as np
import pytest

from omniweave.data.packing import bins as packing
from omniweave.data.packing.packed import PackedDataset
from omniweave.errors import UserError
from tests.fakes_data import make_samples, pack_cli, write_raw


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    return write_raw(tmp_path_factory.mktemp("raw"), make_samples())


def _mtimes(out):
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def _packs(out):
    ds = PackedDataset(out)
    return [(ds[k]["input_ids"].tolist(), [d["index"] for d in ds[k]["docs"]]) for k in range(len(ds))]


def test_restart_does_not_redo_finished_phases_or_shards(raw, tmp_path, capsys):
    out = tmp_path / "packed"
    assert pack_cli(raw, out) == 0
    before = _mtimes(out)
    assert pack_cli(raw, out) == 0
    after = _mtimes(out)
    assert {k: v for k, v in after.items() if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"}
    err = capsys.readouterr().err
    assert "scan: slice 0/1 already done" in err and "plan: already done" in err
    # a lost shard is the only thing rewritten
    (out / "packs-000001.json").unlink()
    assert pack_cli(raw, out) == 0
    again = _mtimes(out)
    changed = {k for k in again if again[k] != after.get(k)}
    assert changed == {"packs-000001.bin", "packs-000001.json", "manifest.json"}


def test_worker_slices_plus_final_plan_equal_a_single_run(raw, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert pack_cli(raw, single) == 0
    for i in range(3):
        assert pack_cli(raw, multi, "--phase", "scan", "--worker-index", str(i), "--num-workers", "3") == 0
    assert not (multi / "plan").exists()
    assert pack_cli(raw, multi, "--phase", "plan", "--num-workers", "3") == 0
    for i in (2, 0, 1):
        assert not (multi / "manifest.json").exists()
        assert pack_cli(raw, multi, "--phase", "write", "--worker-index", str(i), "--num-workers", "3") == 0
    assert _packs(multi) == _packs(single)
    s1, s3 = (json.loads((d / "stats.json").read_text()) for d in (single, multi))
    assert {k: v for k, v in s1.items() if k != "plan_seconds"} == {k: v for k, v in s3.items() if k != "plan_seconds"}


def test_plan_refuses_to_run_before_every_scan_slice_is_done(raw, tmp_path, capsys):
    out = tmp_path / "p"
    assert pack_cli(raw, out, "--phase", "scan", "--worker-index", "0", "--num-workers", "2") == 0
    assert pack_cli(raw, out, "--phase", "plan", "--num-workers", "2") == 2  # a user error: one line, exit 2
    assert "scan slices [1] of 2" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"scan slices \[1\] of 2"):  # --debug: the exception itself
        pack_cli(raw, out, "--phase", "plan", "--num-workers", "2", "--debug")


def test_restart_with_other_settings_names_the_field(raw, tmp_path, capsys):
    out = tmp_path / "p"
    assert pack_cli(raw, out) == 0
    assert pack_cli(raw, out, "--max-len", "400") == 2
    assert "build.fingerprint.max_len: packed with 512, now 400" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["balanced", "sequential"])
def test_other_algorithms_and_caps_produce_valid_packs(raw, tmp_path, algorithm):
    out = tmp_path / algorithm
    assert pack_cli(raw, out, "--algorithm", algorithm, "--max-media-per-pack", "3") == 0
    ds = PackedDataset(out)
    assert ds.manifest["algorithm"] == algorithm
    for k in range(len(ds)):
        p = ds[k]
        assert len(p["media"]) <= 3 and len(p["input_ids"]) <= 512
    assert sum(len(ds.record(k)["docs"]) for k in range(len(ds))) == 38


def _pack_demo(tmp_path, n: int) -> dict:
    """Demo data of n samples -> convert -> pack at 4096 (the demo's vision settings); stats.json."""
    from omniweave.cli import main
    from omniweave.data import demo

    demo.generate(tmp_path / "demo", samples=n, eval_samples=0)
    assert main(["data", "convert", "--input", str(tmp_path / "demo" / "train.jsonl"), "--media-dir",
                 str(tmp_path / "demo" / "media"), "--output", str(tmp_path / "raw"), "--workers", "2",
                 "--no-progress"]) == 0
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {tokenizer: demo, template: chatml, max_len: 4096, truncation: drop, rope: mrope,"
                      " vision: {min_pixels: 3136, video_min_pixels: 3136}}\n")
    assert main(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "packed"),
                 "--recipe", str(recipe), "--workers", "2"]) == 0
    return json.loads((tmp_path / "packed" / "stats.json").read_text())


@pytest.fixture(scope="module")
def demo600(tmp_path_factory):
    """600 demo samples converted and packed at 4096: (stats.json, the packed dataset)."""
    tmp = tmp_path_factory.mktemp("demo600")
    return _pack_demo(tmp, 600), PackedDataset(tmp / "packed")


@pytest.mark.slow
def test_demo_dataset_packs_to_the_optimal_pack_count(demo600):
    s, packed = demo600
    assert s["samples_packed"] == 600 and s["dropped_total"] == 0
    # few packs: the last one is partial, so the bound is the pack count, not 99.5 %
    assert s["packs"] == math.ceil(s["real_tokens"] / 4096)
    full = np.asarray([packed.record(k)["length"] for k in range(s["packs"])])
    assert np.sort(full)[1:].mean() / 4096 >= 0.995, "every pack but the last is ≥ 99.5 % full"


@pytest.mark.slow
def test_demo_dataset_efficiency_at_4096(demo600):
    """The issue asks for >= 99.5 % on the demo data at max length 4096. Demo samples are 35-67 tokens, so
    plain BFD leaves every pack a gap of up to 34 tokens and, from 20K samples on, ends 1-2 packs over
    ceil(tokens / 4096); bfd's gap-closing refinement removes them. Measured on real packs
    (docs/benchmarks.md, bench/pack.py): 16K samples 99.49 % (the optimum: the part-full last pack costs
    the rest), 20K 99.78 % (the optimum; plain BFD one pack more, 99.31 %), 24K 99.66 %, 32K 99.75 %.
    The packer sees only sample lengths, so 20K lengths drawn (seeded, with replacement) from the 600
    packed demo samples' stand for 20K converted ones here (converting 20K took ~100 s of CI)."""
    s, packed = demo600
    real = np.asarray([d["length"] for k in range(s["packs"]) for d in packed.record(k)["docs"]], np.int64)
    assert len(real) == 600 and real.sum() == s["real_tokens"]
    lengths = np.random.default_rng(0).choice(real, 20_000)
    plan, plain = packing.pack(lengths, 4096), packing.bfd(lengths, 4096, refine=False)
    assert plan.dropped.size == 0 and sorted(plan.items.tolist()) == list(range(20_000))
    assert plan.num_packs == math.ceil(lengths.sum() / 4096) < plain.num_packs
    assert plan.efficiency(lengths) >= 0.995, plan.efficiency(lengths)


def test_no_progress_bars_are_drawn_into_pipes_or_logs(tmp_path, capfd):
    """Issue 32, item 9: stderr that is not a terminal (a pipe, a log file) gets no bar redraws."""
    from tests.fakes_data import build_packed

    build_packed(tmp_path, samples=make_samples(n_text=6, n_image=1, n_video=0, rejects=False))
    err = capfd.readouterr().err
    assert "\r" not in err and "scan 0/1" not in err and "write 0/1" not in err, err[:500]


def test_undesirable_kto_samples_are_dropped_from_sft_packs_with_a_reason(tmp_path):
    """Issue 32, item 5: a KTO row marked undesirable is no SFT target: counted, never trained on."""
    from omniweave.data.sample import Conversation, Message
    from tests.fakes_data import build_packed

    def row(i, tag):
        return (Conversation(f"kto-{i}", [Message("user", f"question {i}"), Message("assistant", "an answer")],
                             meta={"kto_tag": tag}), {})

    _, out = build_packed(tmp_path, samples=[row(0, True), row(1, False), row(2, False), row(3, True)])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["dropped"] == {"kto_undesirable": 2} and stats["samples_packed"] == 2
    packed = PackedDataset(out)
    assert sorted(d["id"] for k in range(len(packed)) for d in packed.record(k)["docs"]) == ["kto-0", "kto-3"]


def test_per_turn_loss_weights_survive_convert_shards_and_packing(tmp_path):
    """Issue 32, item 4, on packed rows: the first answer (loss_weight 0) has no label in the pack."""
    from omniweave.data.sample import Conversation, Message
    from omniweave.data.text.tokenizer import load_tokenizer
    from tests.fakes_data import build_packed

    turns = [Message("user", "first question"), Message("assistant", "first answer", 0.0),
             Message("user", "second"), Message("assistant", "last answer")]
    _, out = build_packed(tmp_path, samples=[(Conversation("w", turns), {})])
    (pack,) = [PackedDataset(out)[k] for k in range(len(PackedDataset(out)))]
    targets = pack["labels"][pack["labels"] != -100]
    assert load_tokenizer("demo").decode(targets) == "last answer<|im_end|>\n"
