"""data.mix (omniweave/data/loading/mix.py): several packed datasets sampled by weight or epochs,
deterministic, exactly resumable (also across dp sizes, with cost balancing and loader workers),
checked per dataset, counted per dataset in the metrics."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from omniweave.data.loading.loader import PackedLoader
from omniweave.data.loading.mix import MixCounts, MixEntry, PackMix, batch_counts, data_source, floor_sum, parse_mix
from omniweave.data.packing.packed import PackedDataset
from omniweave.errors import UserError
from tests.fakes_data import DATA_CFG, build_packed, make_samples


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three packed datasets of different sizes: name -> path (media packs, text packs, a tiny one)."""
    root = tmp_path_factory.mktemp("mix")
    sets = {"media": None, "text": make_samples(80, 0, 0, rejects=False), "tiny": make_samples(8, 3, 0, rejects=False)}
    return {name: build_packed(root / name, samples=samples)[1] for name, samples in sets.items()}


def _mix(three, **shares):
    """A data.mix list: shares = {name: ("weight" | "epochs", value)}."""
    return [{"path": str(three[n]), kind: v, "name": n} for n, (kind, v) in shares.items()]


WEIGHTS = {"media": ("weight", 0.5), "text": ("weight", 0.3), "tiny": ("weight", 0.2)}


def _ids(loader, steps):
    it = loader.iter_pack_ids()
    return [next(it) for _ in range(steps)]


def _dataset_of(loader, refs):
    return [loader.mix.locate(r)[0] for r in refs]


# ---------------------------------------------------------------------------- the stream


def test_floor_sum_is_exact():
    rng = random.Random(0)
    for _ in range(500):
        n, m, a, b = rng.randrange(80), rng.randrange(1, 60), rng.randrange(200), rng.randrange(200)
        assert floor_sum(n, m, a, b) == sum((a * k + b) // m for k in range(n))
    n = 7 * 10**11  # no loop over n: Σ floor(3k/7) = (3·n(n-1)/2 - (n/7)·Σ_r (3r mod 7)) / 7, Σ_r (3r mod 7) = 21
    assert floor_sum(n, 7, 3, 0) == (3 * n * (n - 1) // 2 - n // 7 * 21) // 7


def test_weights_give_their_proportions_within_one_percent_over_10k_packs(three):
    loader = PackedLoader(None, 100, 0, 1, seed=0, mix=_mix(three, **WEIGHTS))
    refs = sum(_ids(loader, 100), [])
    counts = np.bincount(_dataset_of(loader, refs), minlength=3)
    share = counts / counts.sum()
    error = np.abs(share - [0.5, 0.3, 0.2]).max()
    assert counts.sum() == 10_000 and error < 0.01, (counts, error)
    assert error < 0.001  # measured 0.0001: the golden-ratio interleave is within a couple of packs
    assert loader.mix.consumed(10_000) == counts.tolist()


def test_each_dataset_runs_its_own_seeded_epochs(three):
    """The tiny dataset repeats (epoch after epoch, each a permutation) while the others go on."""
    loader = PackedLoader(None, 50, 0, 1, seed=4, mix=_mix(three, **WEIGHTS))
    refs = sum(_ids(loader, 4), [])
    for i, size in enumerate(loader.mix.sizes):
        mine = [loader.mix.locate(r)[1] for r in refs if loader.mix.locate(r)[0] == i]
        for e in range(len(mine) // size):
            assert sorted(mine[e * size : (e + 1) * size]) == list(range(size))
        assert mine[: size] == loader.mix.dataset_order(i, 0).tolist()
    tiny = loader.mix.names.index("tiny")
    assert loader.mix.consumed(200)[tiny] > 3 * loader.mix.sizes[tiny]  # several epochs of the tiny one


def test_an_epochs_mix_takes_each_dataset_epochs_times_per_cycle(three):
    mix = _mix(three, media=("epochs", 2), text=("epochs", 1), tiny=("epochs", 3))
    loader = PackedLoader(None, 7, 0, 1, seed=1, mix=mix)
    sizes, period = loader.mix.sizes, loader.mix.period
    assert loader.mix.quotas == [2 * sizes[0], sizes[1], 3 * sizes[2]] and period == sum(loader.mix.quotas)
    refs = sum(_ids(loader, -(-3 * period // 7)), [])[: 3 * period]
    for c in range(3):  # every cycle: each pack of a dataset exactly `epochs` times
        cycle = refs[c * period : (c + 1) * period]
        for i, epochs in enumerate((2, 1, 3)):
            local = sorted(loader.mix.locate(r)[1] for r in cycle if loader.mix.locate(r)[0] == i)
            assert local == sorted(list(range(sizes[i])) * epochs)
    # over 10k packs the shares are those of epochs x packs
    loader = PackedLoader(None, 100, 0, 1, seed=1, mix=mix)
    counts = np.bincount(_dataset_of(loader, sum(_ids(loader, 100), [])), minlength=3)
    want = np.array(loader.mix.quotas) / period
    assert np.abs(counts / 10_000 - want).max() < 0.01


def test_same_seed_same_stream_other_seed_other_stream(three):
    def stream(seed):
        return _ids(PackedLoader(None, 8, 0, 1, seed=seed, mix=_mix(three, **WEIGHTS)), 30)

    assert stream(3) == stream(3)
    assert stream(3) != stream(4)
    a = PackedLoader(None, 8, 0, 1, seed=3, mix=_mix(three, **WEIGHTS))
    b = PackedLoader(None, 8, 0, 1, seed=4, mix=_mix(three, **WEIGHTS))
    assert a.mix.choices(0, 200).tolist() != b.mix.choices(0, 200).tolist()  # the dataset order too


def test_a_position_far_into_the_run_is_reached_without_replaying_it(three):
    """The state is the stream position: counts before it come from floor sums, equal to counting."""
    mix = PackedLoader(None, 8, 0, 1, seed=2, mix=_mix(three, **WEIGHTS)).mix
    n = 10**9 + 7
    counts = mix.consumed(n)
    assert sum(counts) == n
    chosen = mix.choices(n, 1000)
    after = mix.consumed(n + 1000)
    assert [after[i] - counts[i] for i in range(3)] == np.bincount(chosen, minlength=3).tolist()


# ---------------------------------------------------------------------------- resume


def test_resume_mid_mix_continues_the_uninterrupted_stream(three):
    mix = _mix(three, **WEIGHTS)
    full = _ids(PackedLoader(None, 6, 0, 1, seed=1, mix=mix), 12)
    first = PackedLoader(None, 6, 0, 1, seed=1, mix=mix)
    head = _ids(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json holds it
    assert [m["consumed"] for m in state["mix"]] == first.mix.consumed(30)
    resumed = PackedLoader(None, 6, 0, 1, seed=1, mix=mix)
    resumed.load_state_dict(state)
    assert head + _ids(resumed, 7) == full


@pytest.mark.parametrize("balance", [None, "cost"])
def test_resume_with_dp_size_2_to_4_neither_skips_nor_repeats(three, balance):
    G, k, rest = 8, 3, 4
    mix = _mix(three, **WEIGHTS)
    full = _ids(PackedLoader(None, G, 0, 1, seed=2, mix=mix), k + rest)
    two = [PackedLoader(None, G, r, 2, seed=2, mix=mix, balance=balance) for r in range(2)]
    got = [_ids(ld, k) for ld in two]
    assert len({json.dumps(ld.state_dict(), sort_keys=True) for ld in two}) == 1
    four = [PackedLoader(None, G, r, 4, seed=2, mix=mix, balance=balance) for r in range(4)]
    for ld in four:
        ld.load_state_dict(json.loads(json.dumps(two[0].state_dict())))
    more = [_ids(ld, rest) for ld in four]
    for s in range(k):
        assert sorted(got[0][s] + got[1][s]) == sorted(full[s])
    for s in range(rest):
        assert sorted(sum((more[r][s] for r in range(4)), [])) == sorted(full[k + s])
    if balance is None:  # contiguous shares: rank r holds its slice of the global batch
        assert sum((more[r][0] for r in range(4)), []) == full[k]
    # the same shares as a 4-rank run that never stopped
    whole = [PackedLoader(None, G, r, 4, seed=2, mix=mix, balance=balance) for r in range(4)]
    assert [_ids(ld, k + rest)[k:] for ld in whole] == more


def test_worker_processes_resolve_mix_references_and_resume_exactly(three):
    """num_workers=1 gives the batches of num_workers=0 (each micro-batch from its dataset), and a
    state taken while the worker runs ahead resumes at the trainer's position."""
    mix = _mix(three, **WEIGHTS)

    def take(nw, steps, state=None):
        ld = PackedLoader(None, 4, 1, 2, seed=7, mix=mix, num_workers=nw, balance="cost", data_cfg=DATA_CFG)
        if state is not None:
            ld.load_state_dict(state)
        it = iter(ld)
        out = []
        for _ in range(steps):
            batch = next(it)
            out.append([(ld.batch_sources[j], mb["input_ids"].tolist(), round(mb["pixel_values"].sum().item(), 3))
                        for j, mb in enumerate(batch)])
        return out, ld.state_dict()

    plain, _ = take(0, 6)
    workers, _ = take(1, 6)
    assert workers == plain
    _, state = take(1, 3)
    resumed, _ = take(1, 3, json.loads(json.dumps(state)))
    assert resumed == plain[3:]
    datasets = [PackedDataset(p) for p in three.values()]
    ref = PackedLoader(None, 4, 1, 2, seed=7, mix=mix, balance="cost")
    for step, share in zip(plain, _ids(ref, 6)):
        for (source, ids, _), r in zip(step, share):
            i, local = ref.mix.locate(r)
            assert source == i and ids == datasets[i][local]["input_ids"].tolist()


def test_a_state_of_another_mix_or_of_one_dataset_is_refused(three):
    mix = _mix(three, **WEIGHTS)
    one = PackedLoader(three["text"], 4, 0, 1)
    mixed = PackedLoader(None, 4, 0, 1, mix=mix)
    with pytest.raises(UserError, match="data.mix: media, text, tiny.*data.path="):
        one.load_state_dict(mixed.state_dict())
    with pytest.raises(UserError, match="of one packed dataset"):
        mixed.load_state_dict(one.state_dict())
    other = PackedLoader(None, 4, 0, 1, mix=_mix(three, media=("weight", 0.5), text=("weight", 0.5),
                                                 tiny=("weight", 0.2)))
    with pytest.raises(UserError, match="data.mix entry 'media'.*per mix cycle"):
        mixed.load_state_dict(other.state_dict())
    assert "mix" not in one.state_dict()  # one dataset: the state it always had


# ---------------------------------------------------------------------------- counts


def test_per_dataset_counts_are_the_packs_and_documents_consumed(three):
    ld = PackedLoader(None, 6, 0, 1, seed=5, mix=_mix(three, **WEIGHTS))
    ref = PackedLoader(None, 6, 0, 1, seed=5, mix=_mix(three, **WEIGHTS))
    counts = MixCounts(ld.mix.names)
    it = iter(ld)
    for share in _ids(ref, 5):
        batch = next(it)
        metrics = counts.add(batch_counts(3, ld.batch_sources, batch))
        assert ld.batch_sources == [ref.mix.locate(r)[0] for r in share]
    refs = sum(_ids(PackedLoader(None, 6, 0, 1, seed=5, mix=_mix(three, **WEIGHTS)), 5), [])
    for i, name in enumerate(ld.mix.names):
        mine = [r for r in refs if ld.mix.locate(r)[0] == i]
        assert metrics[f"mix_packs.{name}"] == len(mine) == ld.mix.consumed(30)[i]
        assert metrics[f"mix_samples.{name}"] == sum(len(ld.mix.record(r)["docs"]) for r in mine)
    again = MixCounts(ld.mix.names)
    again.load_state_dict(json.loads(json.dumps(counts.state_dict())))
    assert again.add([0] * 6) == metrics


# ---------------------------------------------------------------------------- mistakes


def test_path_and_mix_exclude_each_other_and_one_is_needed(three):
    with pytest.raises(UserError, match="data.path=.* and data.mix are both set.*data.path=null"):
        data_source({"path": str(three["text"]), "mix": _mix(three, **WEIGHTS)})
    with pytest.raises(UserError, match="data.path is not set.*or data.mix"):
        data_source({"path": None, "mix": None})
    assert data_source({"path": "x", "mix": None}) == ("x", None)
    assert data_source({"path": "???", "mix": [{"path": "a/b", "weight": 1}]}) == (None, [MixEntry("b", "a/b", 1.0)])


@pytest.mark.parametrize("mix, message", [
    ([], "data.mix is empty"),
    ([{"path": "a", "weight": 1, "epochs": 2}], r"entry 1 \('a'\): give it a weight .* not both"),
    ([{"path": "a"}], r"entry 1 \('a'\): give it a weight"),
    ([{"path": "a", "weight": 1}, {"path": "b", "epochs": 2}], r"mixes weight entries \(a\) with epochs entries \(b\)"),
    ([{"path": "a", "weight": 0}], r"weight=0 must be a number > 0"),
    ([{"path": "a", "epochs": -1}], r"epochs=-1 must be a number > 0"),
    ([{"path": "a", "weight": "much"}], r"weight='much' must be a number > 0"),
    ([{"weight": 1}], "entry 1 has no path"),
    ([{"path": "a", "wieght": 1}], r"unknown key\(s\) wieght"),
    ([{"path": "x/a", "weight": 1}, {"path": "x/a", "weight": 1}], "two entries are named 'x/a'"),
    ([{"path": "x/a", "weight": 1, "name": "b"}, {"path": "y/b", "weight": 1}], "two entries are named 'b'"),
])
def test_a_bad_mix_is_one_line_naming_the_entry(mix, message):
    with pytest.raises(UserError, match=message):
        parse_mix(mix)


def test_default_names_are_the_folder_or_as_many_last_folders_as_tell_them_apart():
    mix = [{"path": "/d/web/packed", "weight": 1}, {"path": "/d/code/packed", "weight": 1},
           {"path": "runs/math", "weight": 1}, {"path": "/x/packed", "weight": 1, "name": "n"}]
    names = [e.name for e in parse_mix(mix)]
    assert names == ["web/packed", "code/packed", "math", "n"]


def test_a_dataset_packed_with_other_settings_is_named(three, demo_packed):
    """demo_packed was built by the demo recipe: its fingerprint differs from the fakes' DATA_CFG."""
    mix = _mix(three, text=("weight", 1)) + [{"path": str(demo_packed), "weight": 1, "name": "demo"}]
    with pytest.raises(UserError, match=r"packed dataset .* \(data.mix entry 'demo'\) was built with different data"):
        PackedLoader(None, 2, 0, 1, data_cfg=DATA_CFG, mix=mix)
    PackedLoader(None, 2, 0, 1, data_cfg={**DATA_CFG, "path": None, "mix": mix[:1]}, mix=mix[:1])


def test_a_dataset_of_another_kind_is_named(three, tmp_path):
    from omniweave.data.loading.mix import check_mix_ready

    prompts = tmp_path / "prompts"
    shutil.copytree(three["tiny"], prompts)
    manifest = json.loads((prompts / "manifest.json").read_text())
    (prompts / "manifest.json").write_text(json.dumps({**manifest, "kind": "prompts"}))
    mix = parse_mix(_mix(three, text=("weight", 1)) + [{"path": str(prompts), "weight": 1}])
    with pytest.raises(UserError, match="data.mix entry 'prompts': path=.* holds RL prompts"):
        check_mix_ready(mix, "sft")
    with pytest.raises(UserError, match="data.mix entry 'prompts': path=.* holds RL prompts"):
        PackedLoader(None, 2, 0, 1, mix=mix)
    with pytest.raises(UserError, match="data.mix entry 'gone': path=.*: no packed dataset there"):
        check_mix_ready(parse_mix([{"path": str(tmp_path / "nothing"), "weight": 1, "name": "gone"}]), "sft")


def test_a_resume_refuses_a_changed_mix_but_follows_moved_datasets():
    from omniweave.train.resume_keys import changed_keys, may_change

    old = {"data": {"mix": [{"path": "/a/web", "weight": 0.7}, {"path": "/a/code", "weight": 0.3}]}}
    moved = {"data": {"mix": [{"path": "/b/web", "weight": 0.7}, {"path": "/b/code", "weight": 0.3}]}}
    reweighted = {"data": {"mix": [{"path": "/a/web", "weight": 0.5}, {"path": "/a/code", "weight": 0.5}]}}
    (key, (a, b)), = changed_keys(old, moved).items()
    assert key == "data.mix" and may_change(key, a, b)
    (key, (a, b)), = changed_keys(old, reweighted).items()
    assert not may_change(key, a, b)
    assert not may_change("data.mix", old["data"]["mix"], old["data"]["mix"][:1])
    assert not may_change("data.mix", None, old["data"]["mix"])


def test_rl_prompt_datasets_mix_too(tmp_path):
    """``omniweave rl`` reads a mix of prompt datasets: each prompt keeps its answer and its dataset."""
    from omniweave.cli import main

    for name, words in (("colours", ["red", "blue", "green"]), ("sums", ["3", "5"])):
        rows = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
                for w in words]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        raw, prompts = tmp_path / name / "raw", tmp_path / name / "prompts"
        assert main(["data", "convert", "--input", str(tmp_path / f"{name}.jsonl"), "--output", str(raw),
                     "--workers", "1", "--no-progress"]) == 0
        assert main(["data", "pack", "--input", str(raw), "--output", str(prompts), "--recipe", "demo_grpo",
                     "--workers", "1"]) == 0
    mix = [{"path": str(tmp_path / "colours/prompts"), "epochs": 1},
           {"path": str(tmp_path / "sums/prompts"), "epochs": 2}]
    loader = PackedLoader(None, 7, 0, 1, kind="prompts", mix=mix)
    batch = next(iter(loader))  # one mix cycle: 3 colours once, 2 sums twice
    answers = sorted((loader.mix.names[i], mb["prompt"]["answer"]) for i, mb in zip(loader.batch_sources, batch))
    assert answers == sorted([("colours/prompts", w) for w in ("red", "blue", "green")]
                             + [("sums/prompts", w) for w in ("3", "5")] * 2)


def test_mix_is_a_loader_only_key():
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS

    assert "mix" in LOADER_ONLY_KEYS


def test_pack_mix_describes_its_shares(three):
    mix = PackMix(parse_mix(_mix(three, **WEIGHTS)), seed=0)
    assert mix.describe(8).startswith(f"mix of 3 datasets ({mix.num_packs} packs): media 50.0% ")


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.usefixtures("one_intra_op_thread")
def test_a_resumed_mix_run_equals_an_uninterrupted_one(demo_packed, tmp_path_factory, tmp_path):
    """Two demo datasets mixed 0.6 / 0.4, 4 steps; resumed from step 2: the same losses and
    per-dataset counts, which are the packs of the stream and the documents in them."""
    from tests.train_factory import make_demo_packed, read_metrics, train_in_process

    small = make_demo_packed(tmp_path_factory.mktemp("mix_small"), samples=60)
    mix = f"[{{path: '{demo_packed}', weight: 0.6, name: big}}, {{path: '{small}', weight: 0.4, name: small}}]"
    keys = ("step", "loss", "grad_norm", "tokens", "mix_packs.big", "mix_packs.small", "mix_samples.big",
            "mix_samples.small")

    def run(out, resume=None):
        train_in_process(demo_packed, out, resume=resume, steps=4, global_batch=4, train__save_interval=2,
                         train__keep_last=0, data__path="null", data__mix=mix)
        return [{k: m[k] for k in keys} for m in read_metrics(out)]

    whole = run(tmp_path / "whole")
    step2 = "checkpoints/step_000002"
    shutil.copytree(tmp_path / "whole" / step2, tmp_path / "cut" / step2)
    assert run(tmp_path / "cut", resume="auto") == whole[2:]
    entries = parse_mix([{"path": str(demo_packed), "weight": 0.6, "name": "big"},
                         {"path": str(small), "weight": 0.4, "name": "small"}])
    loader = PackedLoader(None, 4, 0, 1, seed=0, mix=entries)
    refs = sum(_ids(loader, 4), [])
    last = whole[-1]
    assert [last["mix_packs.big"], last["mix_packs.small"]] == loader.mix.consumed(16)
    docs = [0, 0]
    for r in refs:
        docs[loader.mix.locate(r)[0]] += len(loader.mix.record(r)["docs"])
    assert [last["mix_samples.big"], last["mix_samples.small"]] == docs
