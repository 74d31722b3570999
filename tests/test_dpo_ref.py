"""``train.dpo.ref=precomputed`` (train/dpo_ref.py): ``omniweave dpo precompute-ref`` stores the
initial policy's sequence log-probs of every pair; a run reading them equals a run with the frozen
reference model (``ref: model``) without building one; a file for other data or another model is
refused, naming what differs; the write is atomic."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from omniweave.cli import main as cli
from tests.dpo_factory import dpo_overrides, make_pairs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The demo pairs (17 packs of 48 pairs) with their reference log-probs at the default path."""
    pairs = make_pairs(tmp_path_factory.mktemp("dpo_ref"))
    assert cli(["dpo", "precompute-ref", "demo_dpo", *dpo_overrides(pairs, pairs.parent / "x"), "--no-progress"]) == 0
    return pairs


def _cfg(pairs, out, *extra, **kw):
    from omniweave.config import load_recipe

    return load_recipe("demo_dpo", dpo_overrides(pairs, out, **kw) + list(extra))


def _check(cfg):
    from omniweave.train.trainer import check_ready, phase_kind

    check_ready(cfg, None, kind=phase_kind(cfg))


@pytest.mark.slow
def test_a_precomputed_reference_gives_the_losses_and_rewards_of_the_reference_model(pairs, tmp_path, monkeypatch):
    from omniweave.train import dpo
    from omniweave.train.trainer import train
    from tests.train_factory import read_metrics

    keys = ("loss", "reward_chosen", "reward_rejected", "reward_accuracy", "grad_norm")
    train(_cfg(pairs, tmp_path / "model", steps=4, train__lr=1e-2))
    with_model = [[m[k] for k in keys] for m in read_metrics(tmp_path / "model")]

    def no_model(*a, **k):
        raise AssertionError("a reference model was built for train.dpo.ref=precomputed")

    monkeypatch.setattr(dpo, "frozen_reference", no_model)
    train(_cfg(pairs, tmp_path / "stored", steps=4, train__lr=1e-2, train__dpo__ref="precomputed"))
    stored = [[m[k] for k in keys] for m in read_metrics(tmp_path / "stored")]
    assert with_model[-1][2] != 0.0  # the policy moved: the rewards compare something
    for a, b in zip(stored, with_model):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)

    # LoRA adapters on the same model: the stored file of the full model is their reference too
    lora = ["+model.foundation.lora={r: 4, alpha: 8, targets: all-linear}", "model.image_encoder.freeze=true",
            "model.projector.freeze=true"]
    monkeypatch.undo()
    train(_cfg(pairs, tmp_path / "lora_base", *lora, steps=3, train__lr=1e-2))  # the adapters-off reference
    train(_cfg(pairs, tmp_path / "lora_stored", *lora, steps=3, train__lr=1e-2, train__dpo__ref="precomputed"))
    base, stored = (read_metrics(tmp_path / d) for d in ("lora_base", "lora_stored"))
    assert base[-1]["reward_chosen"] != 0.0
    for a, b in zip(stored, base):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-6, abs=1e-9)


def test_the_stored_file_holds_every_pair_with_its_reference(pairs):
    from omniweave.data.packing.packed import PackedDataset

    with np.load(pairs / "ref_logps.npz", allow_pickle=False) as z:
        logps, offsets, index, identity = z["logps"], z["offsets"], z["pair_index"], str(z["identity"])
    ds = PackedDataset(pairs)
    assert offsets.tolist() == np.cumsum([0] + [len(ds.record(i)["docs"]) // 2 for i in range(len(ds))]).tolist()
    assert logps.shape == (48, 2) and sorted(index.tolist()) == list(range(48))
    assert (logps < 0).all()  # sums of token log-probs of non-empty answers
    assert '"seed": 0' in identity and '"hidden_size": 64' in identity and '"freeze"' not in identity


def test_a_missing_or_mismatched_reference_file_fails_naming_the_keys(pairs, tmp_path):
    from omniweave.errors import UserError

    with pytest.raises(UserError, match="train.dpo.ref_path applies to train.dpo.ref=precomputed"):
        _check(_cfg(pairs, tmp_path, train__dpo__ref_path=tmp_path / "r.npz"))
    with pytest.raises(UserError, match=r"no reference log-probs at .*r\.npz \(train\.dpo\.ref_path.*precompute-ref"):
        _check(_cfg(pairs, tmp_path, train__dpo__ref="precomputed", train__dpo__ref_path=tmp_path / "r.npz"))
    for extra, match in ((["model.foundation.rms_norm_eps=1e-5"], r"model\.foundation\.rms_norm_eps: stored 1e-06, "
                                                                  r"now 1e-05"),
                         (["train.seed=1"], r"train\.seed=0 stored, now 1"),
                         ([f"train.init_from={tmp_path}"], r"train\.seed=0 stored, now train\.init_from=")):
        with pytest.raises(UserError, match="another reference model's log-probs.*" + match):
            _check(_cfg(pairs, tmp_path, *extra, train__dpo__ref="precomputed"))
    # what trains and the layout leave the reference as it is
    _check(_cfg(pairs, tmp_path, "model.image_encoder.freeze=true", "model.foundation.tp=1",
                train__dpo__ref="precomputed"))

    other = make_pairs(tmp_path / "other", pairs=24)  # other data: fewer packs
    shutil.copy(pairs / "ref_logps.npz", other / "ref_logps.npz")
    with pytest.raises(UserError, match=r"computed for other data .*: 17 packs stored, the data has \d+"):
        _check(_cfg(other, tmp_path, train__dpo__ref="precomputed"))
    with np.load(pairs / "ref_logps.npz", allow_pickle=False) as z:  # as many packs, pairs moved between two
        arrays = dict(z)
    arrays["offsets"][3] += 1
    np.savez(tmp_path / "moved.npz", **arrays)
    with pytest.raises(UserError, match=r"other data .*: pack 2 holds other pairs"):
        _check(_cfg(pairs, tmp_path, train__dpo__ref="precomputed", train__dpo__ref_path=tmp_path / "moved.npz"))


def test_init_from_weights_replaced_in_place_no_longer_match(pairs, tmp_path):
    """Values stored for ``train.init_from=DIR`` carry DIR's weight files' sizes and times: the same
    path with rewritten weights is refused, naming it; untouched, it matches."""
    import types

    from omniweave.errors import UserError
    from omniweave.train.dpo_ref import StoredReference, identity

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"0" * 64)
    cfg = _cfg(pairs, tmp_path, f"train.init_from={hf}", train__dpo__ref="precomputed")
    stored = {"format": "omniweave-dpo-ref/1", **identity(cfg)}
    holder = types.SimpleNamespace(path=tmp_path / "r.npz")
    StoredReference._check_identity(holder, stored, identity(cfg))  # unchanged: accepted
    (hf / "model.safetensors").write_bytes(b"1" * 65)  # new weights, same path
    with pytest.raises(UserError, match=r"train\.init_from='.*hf': its weight files changed since the values were stored"):
        StoredReference._check_identity(holder, stored, identity(cfg))


def test_precompute_writes_atomically_and_where_asked(pairs, tmp_path, monkeypatch):
    """A write that fails halfway (disk full) leaves the previous file or none, and no temporary."""
    from omniweave.train import dpo_ref

    out = tmp_path / "ref" / "r.npz"
    cfg = _cfg(pairs, tmp_path, train__dpo__ref="precomputed", train__dpo__ref_path=out)
    savez = np.savez

    def disk_full(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError, match="No space left"):
        dpo_ref.precompute(cfg, out, progress=False)
    assert list(out.parent.iterdir()) == []  # no partial file, no temporary left behind
    monkeypatch.setattr(np, "savez", savez)
    layout = ["model.foundation.tp=2", "parallel.cp=2"]  # the training run's layout: one process here all the same
    assert cli(["dpo", "precompute-ref", "demo_dpo", *dpo_overrides(pairs, tmp_path), *layout, "--output", str(out),
                "--no-progress"]) == 0
    before = out.read_bytes()
    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError, match="No space left"):
        dpo_ref.precompute(cfg, out, progress=False)
    assert out.read_bytes() == before and [p.name for p in out.parent.iterdir()] == ["r.npz"]  # the old file intact
    _check(cfg)  # the run finds and accepts it through train.dpo.ref_path
    with np.load(out) as a, np.load(pairs / "ref_logps.npz") as b:  # deterministic: the same reference
        assert all(np.array_equal(a[k], b[k]) for k in ("logps", "offsets", "pair_index", "identity"))
