"""PackedLoader: the contract micro-batch, seeded epochs, exact resume (also across DP sizes),
worker decoding, fingerprint check."""

import json

import pytest
import torch

from omniweave.data.loading.loader import PackedLoader
from omniweave.data.packing.packed import PackedDataset
from tests.fakes_data import DATA_CFG, build_packed

KEYS = {"input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values", "grid_thw", "media_spans",
        "num_loss_tokens"}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    # sequential packing of a text-first sample order -> text-only packs and media packs
    return build_packed(tmp_path_factory.mktemp("loader"), "--algorithm", "sequential")[1]


def _ids(loader, steps):
    it = loader.iter_pack_ids()
    return [next(it) for _ in range(steps)]


def test_micro_batch_is_exactly_the_contract_dict(packed):
    ds = PackedDataset(packed)
    loader = PackedLoader(packed, global_batch=len(ds), dp_rank=0, dp_size=1, data_cfg=DATA_CFG)
    (share,) = _ids(PackedLoader(packed, len(ds), 0, 1), 1)
    batch = next(iter(loader))
    assert len(batch) == len(ds)
    for mb, k in zip(batch, share):
        assert set(mb) == KEYS
        p = ds[k]
        L = len(p["input_ids"])
        assert mb["input_ids"].dtype == torch.int64 and mb["input_ids"].tolist() == p["input_ids"].tolist()
        assert mb["labels"].dtype == torch.int64 and mb["labels"].shape == (L,)
        assert mb["position_ids"].shape == (3, L) and mb["position_ids"].dtype == torch.int64
        assert mb["cu_seqlens"].dtype == torch.int32 and mb["cu_seqlens"][-1] == L
        M = len(p["media"])
        assert mb["grid_thw"].shape == (M, 3) and mb["media_spans"].shape == (M, 2)
        assert mb["pixel_values"].dtype == torch.float32 and mb["pixel_values"].shape[1] == 3 * 2 * 14 * 14
        assert mb["pixel_values"].shape[0] == int(mb["grid_thw"].prod(-1).sum())
        assert mb["num_loss_tokens"] == int((mb["labels"] != -100).sum())


def test_text_only_and_video_packs_sit_in_one_global_batch_on_different_ranks(packed):
    n = len(PackedDataset(packed))
    batches = [next(iter(PackedLoader(packed, n, r, n))) for r in range(n)]
    kinds = [(mb[0]["pixel_values"].shape[0] == 0, bool((mb[0]["grid_thw"][:, 0] > 1).any())) for mb in batches]
    assert any(text for text, _ in kinds) and any(video for _, video in kinds)


def test_every_epoch_is_a_seeded_permutation_of_all_packs(packed):
    n = len(PackedDataset(packed))
    stream = sum(_ids(PackedLoader(packed, 1, 0, 1, seed=3), 3 * n), [])
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    assert stream[:n] != stream[n : 2 * n]
    assert stream == sum(_ids(PackedLoader(packed, 1, 0, 1, seed=3), 3 * n), [])
    assert stream != sum(_ids(PackedLoader(packed, 1, 0, 1, seed=4), 3 * n), [])


def test_resume_continues_exactly_where_an_uninterrupted_run_is(packed):
    full = _ids(PackedLoader(packed, 2, 0, 1, seed=1), 9)  # crosses epoch boundaries
    first = PackedLoader(packed, 2, 0, 1, seed=1)
    head = _ids(first, 4)
    resumed = PackedLoader(packed, 2, 0, 1, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert head + _ids(resumed, 5) == full


def test_resume_with_dp_size_changed_4_to_2_neither_skips_nor_repeats(packed):
    G, k, rest = 4, 3, 4
    full = _ids(PackedLoader(packed, G, 0, 1, seed=2), k + rest)
    four = [PackedLoader(packed, G, r, 4, seed=2) for r in range(4)]
    got = [_ids(ld, k) for ld in four]
    states = {json.dumps(ld.state_dict(), sort_keys=True) for ld in four}
    assert len(states) == 1, "every rank holds the same state"
    two = [PackedLoader(packed, G, r, 2, seed=2) for r in range(2)]
    for ld in two:
        ld.load_state_dict(four[0].state_dict())
    more = [_ids(ld, rest) for ld in two]
    for s in range(k):
        assert sum((got[r][s] for r in range(4)), []) == full[s]
    for s in range(rest):
        assert sum((more[r][s] for r in range(2)), []) == full[k + s]


def test_iterating_real_batches_advances_the_state_like_the_id_stream(packed):
    a = PackedLoader(packed, 2, 1, 2, seed=5)
    it = iter(a)
    got = [[mb["input_ids"].tolist() for mb in next(it)] for _ in range(3)]
    state = a.state_dict()
    ref = PackedLoader(packed, 2, 1, 2, seed=5)
    ids = _ids(ref, 3)
    ds = PackedDataset(packed)
    assert got == [[ds[i]["input_ids"].tolist() for i in share] for share in ids]
    assert state == ref.state_dict()


def test_worker_processes_give_the_same_batches(packed):
    def take(nw):
        it = iter(PackedLoader(packed, 2, 0, 1, seed=7, num_workers=nw))
        return [[(mb["input_ids"].sum().item(), mb["pixel_values"].sum().item()) for mb in next(it)] for _ in range(3)]

    assert take(2) == take(0)


def test_fingerprint_diff_names_a_field_set_on_one_side_only_without_guessing_why():
    # I2V packs under a T2V recipe (or the reverse) differ by whole keys, not by an older omniweave
    from omniweave.data.packing.packed import fingerprint_diff

    built = {"max_len": 512, "diffusion": {"i2v": {"frames": 1}, "fps": 16}}
    wanted = {"max_len": 512, "diffusion": {"fps": 16}, "vla": {"horizon": 8}}
    assert fingerprint_diff(built, wanted) == [
        "data.diffusion.i2v: packed with {'frames': 1}, now without it",
        "data.vla: packed without it, now {'horizon': 8}"]


def test_cost_balance_gives_each_rank_its_share_of_the_global_batch(packed):
    G = 4
    full = _ids(PackedLoader(packed, G, 0, 1), 3)
    shares = [_ids(PackedLoader(packed, G, r, 2, balance="cost"), 3) for r in range(2)]
    for s in range(3):
        assert sorted(shares[0][s] + shares[1][s]) == sorted(full[s]) and len(shares[0][s]) == 2


@pytest.mark.parametrize("field,value,message", [
    ("max_len", 1024, "data.max_len: packed with 512, now 1024"),
    ("template", "qwen2_vl" , "data.template"),
    ("vision", {"max_pixels": 9999}, "data.vision.max_pixels: packed with 12544, now 9999"),
])
def test_fingerprint_mismatch_names_the_field(packed, field, value, message):
    cfg = {**DATA_CFG, field: value}
    if field == "template":
        pytest.importorskip("omniweave.data.text.template")
        from omniweave.data.text.template import BUILTIN_TEMPLATES

        others = [t for t in BUILTIN_TEMPLATES if t != "chatml"]
        if not others:
            pytest.skip("only one built-in template")
        cfg["template"] = others[0]
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        PackedLoader(packed, 2, 0, 1, data_cfg=cfg)
    PackedLoader(packed, 2, 0, 1, data_cfg={**DATA_CFG, "path": str(packed)})  # the same cfg passes
