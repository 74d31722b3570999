"""PackedLoader: seeded per-epoch order over packs, resumable (epoch, cursor) state, DP shares.

    loader = PackedLoader("packed", global_batch=8, dp_rank=r, dp_size=4, seed=0, data_cfg=cfg.data)
    it = iter(loader)
    micro_batches = next(it)          # this rank's 2 packs of the step, one dict per pack
    state = loader.state_dict()       # position AFTER the batch just handed out

The packs form one endless stream: epoch e is the permutation ``default_rng([seed, e])`` of all
pack ids, epochs follow each other, and global batch n is stream[n*G : (n+1)*G] (a batch may
straddle two epochs). ``cursor`` counts packs consumed within ``epoch``, so the state does not
depend on dp_size: resuming with another number of ranks continues the same global batches,
skipping nothing and repeating nothing. Rank r takes packs [r*m, (r+1)*m) of each global batch
(m = G // dp_size), or, with ``balance="cost"``, its group of ``parallel.balance.assign`` over the
packs' predicted costs (``pack_features`` from the pack index, no media decoding, times the cost
model: ``cost_model``, else ``CostModel.from_model_config(model_cfg)``, else ``CostModel.default()``).

``set_cost_model`` (e.g. after ``parallel.balance.Refitter``) takes effect at the first global
batch not yet assigned; the loader keeps the models with the stream position each starts at, and
``state_dict`` carries them, so a resumed run makes the same assignments as an uninterrupted one
(also when DataLoader workers had assigned batches ahead of the trainer).

Iteration never ends by itself (the trainer stops at ``train.steps``); ``steps_per_epoch`` =
num_packs // global_batch.

Where the stream comes from is the loader's ``source``: :class:`OneDataset` (``path``, the stream
above) or, with ``mix=`` (``data.mix``), ``mix.PackMix``: several packed datasets sampled by
weight, each on its own seeded epochs, a reference being a global pack id over the datasets and
(epoch, cursor) the mix cycle and the position in it (mix.py). Everything else here (state, DP
shares, cost balancing, workers) is the same for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from omniweave.data.packing.packed import PackedDataset, check_fingerprint
from omniweave.data.sample import MediaSpan
from omniweave.errors import UserError
from omniweave.parallel.balance import CostModel, assign, imbalance, pack_features, round_robin

# data keys that only steer the loader: left out of the packed dataset's fingerprint
LOADER_ONLY_KEYS = ("path", "mix", "num_workers", "balance", "balance_refit")

_PROCESSORS: dict[str, object] = {}
SKIPS_KEY = "_media_skips"  # how a pack's skip records travel from a loader worker (never leaves the loader)
SOURCE_KEY = "_mix_source"  # the dataset of a mix a micro-batch came from (mix.py; never leaves the loader)


def _processor(data_cfg: dict):
    from omniweave.data.text.tokenize import SampleProcessor

    key = json.dumps(data_cfg, sort_keys=True)
    if key not in _PROCESSORS:  # one per process (loader workers build their own)
        _PROCESSORS[key] = SampleProcessor(data_cfg)
    return _PROCESSORS[key]


def span_from_record(m: dict) -> MediaSpan:
    """A packed media descriptor (``packing/packed.py``) as the MediaSpan it was written from."""
    pieces = [tuple(p) for p in m["pieces"]] if m.get("pieces") else None
    if m["kind"] == "audio":
        return MediaSpan(kind="audio", part=m["part"], grid_thw=(0, 0, 0), resized_hw=(0, 0), start=m["start"],
                         length=m["length"], pieces=pieces, num_samples=m["num_samples"])
    return MediaSpan(kind=m["kind"], part=m["part"], grid_thw=tuple(m["grid_thw"]), resized_hw=tuple(m["resized_hw"]),
                     start=m["start"], length=m["length"], frame_indices=m["frame_indices"],
                     second_per_grid=m["second_per_grid"], pieces=pieces)


def media_batch(proc, items: list[tuple[MediaSpan, bytes]], failed: list | None = None) -> dict:
    """The media tensors of one row from its media spans (positions in the row) and their bytes: the
    one place they are built, for packed micro-batches and evaluation prompts alike. ``failed``: a
    list to tolerate media that do not decode (``MediaError``): such an item gets zeros of its planned
    shape and ``(item index, error)`` is appended; None: the error propagates.

        pixel_values    float32 [P, C*t*p*p]   patches of the images / videos, in order
        grid_thw        int64 [M, 3]           one row per image / video
        media_spans     int64 [S, 2]           (start, length) of each run of vision pads (S >= M)
        image_sizes     int64 [M, 2]           only with data.vision.tiling: anyres (LLaVA-OneVision):
                                               each image's own (height, width), (0, 0) for a video

    and, only when the row has audio (one row per audio-encoder item: a Qwen2-Audio clip over 30 s
    is several items, a Qwen2.5-Omni clip one):

        audio_features  float32 [A, n_mels, W] log-mel of each item padded to 30 s (or its own length
                                               when longer), W the longest; zeros past an item's own
        audio_lengths   int64 [A]              valid mel frames per item
        audio_spans     int64 [S, 2]           (start, length) of each run of audio pads (S >= A): one
                                               run per item, or several consecutive runs per item (a
                                               video's sound track interleaved with it); an item's
                                               runs sum to audio.encoder_tokens(audio_lengths[i])
    """
    vision = [(i, span, data) for i, (span, data) in enumerate(items) if span.kind != "audio"]
    audio = [(i, span, data) for i, (span, data) in enumerate(items) if span.kind == "audio"]
    vc = proc.vision
    patch_dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    pixels = [_decoded(proc.process_media, i, span, data, failed,
                       lambda span=span: np.zeros((int(np.prod(span.grid_thw)), patch_dim), np.float32))
              for i, span, data in vision]
    out = {
        "pixel_values": torch.from_numpy(np.concatenate(pixels).astype(np.float32)) if pixels
        else torch.zeros(0, patch_dim, dtype=torch.float32),
        "grid_thw": torch.tensor([span.grid_thw for _, span, _ in vision], dtype=torch.int64).reshape(-1, 3),
        "media_spans": torch.tensor([r for _, span, _ in vision for r in span.ranges()], dtype=torch.int64).reshape(-1, 2),
    }
    if vc.tiling == "anyres":  # LLaVA-OneVision lays each image's features out by its own size; (0, 0): a video
        sizes = [span.resized_hw if span.kind == "image" else (0, 0) for _, span, _ in vision]
        out["image_sizes"] = torch.tensor(sizes, dtype=torch.int64).reshape(-1, 2)
    if audio:
        out.update(_audio_tensors(proc, audio, failed))
    return out


def _decoded(decode, i: int, span: MediaSpan, data: bytes, failed: list | None, zeros):
    """``decode(span, data)``; with a ``failed`` list, a ``MediaError`` is recorded there and ``zeros()`` returned."""
    from omniweave.data.media.vision import MediaError

    if failed is None:
        return decode(span, data)
    try:
        return decode(span, data)
    except MediaError as e:
        failed.append((i, e))
        return zeros()


def _audio_tensors(proc, audio: list[tuple[int, MediaSpan, bytes]], failed: list | None) -> dict:
    """Decode each clip, cut it into the encoder items it was planned with, log-mel them in one batch."""
    from omniweave.data.media.audio import encoder_items, encoder_tokens
    from omniweave.data.media.mel import log_mel

    clips, runs = [], []
    for i, span, data in audio:
        silence = lambda span=span: [np.zeros(n, np.float32) for n in encoder_items(span.num_samples, proc.audio.family)]
        clips += [torch.from_numpy(item) for item in _decoded(proc.process_audio, i, span, data, failed, silence)]
        runs += span.ranges()
    mel = log_mel(clips, n_mels=proc.audio.n_mels, padding="max_length", truncation=False)
    tokens = [encoder_tokens(int(n)) for n in mel.num_frames]
    item_ends, run_ends = np.cumsum(tokens).tolist(), set(np.cumsum([n for _, n in runs]).tolist())
    if sum(tokens) != sum(n for _, n in runs) or not set(item_ends) <= run_ends:
        raise AssertionError(f"audio items give {tokens} encoder tokens, the row holds pad runs {[n for _, n in runs]}")
    return {"audio_features": mel.features, "audio_lengths": mel.num_frames.to(torch.int64),
            "audio_spans": torch.tensor(runs, dtype=torch.int64).reshape(-1, 2)}


def collate_pack(pack: dict, data_cfg: dict, skips: list | None = None) -> dict:
    """One pack read by PackedDataset -> the model's micro-batch dict (torch tensors, no batch dim).
    ``skips``: a list to tolerate media that do not decode: each such item's pixels / samples are
    zeros and a record naming the pack, sample and file is appended (``media_skip_records``; the
    trainer then takes the loss off the documents they name); None: the ``MediaError`` propagates."""
    proc = _processor(data_cfg)
    extra = {}
    if pack["docs"] and "answer" in pack["docs"][0]:  # an RL prompt (data/packing/prompts.py): who it is, what it expects
        extra["prompt"] = {"uid": int(pack["docs"][0]["index"]), "id": pack["docs"][0]["id"],
                           "answer": pack["docs"][0]["answer"]}
    labels = torch.from_numpy(pack["labels"].astype(np.int64))  # [L] shifted
    cu_seqlens = torch.from_numpy(pack["cu_seqlens"].astype(np.int32))  # [D+1]
    if pack["docs"] and "side" in pack["docs"][0]:  # preference pairs (data/packing/pairs.py, train/dpo.py)
        from omniweave.train.dpo import pair_slots

        extra["token_data"] = {"pair_slot": pair_slots(labels, cu_seqlens, [d["side"] for d in pack["docs"]])}
        extra["num_pairs"] = len(pack["docs"]) // 2
        extra["pack_id"] = int(pack["index"])  # where train.dpo.ref=precomputed finds its pairs' values
    if pack["docs"] and "kto" in pack["docs"][0]:  # KTO completions and their KL documents (data/packing/kto.py)
        from omniweave.train.kto import kto_token_data

        extra["token_data"], extra["num_kto"] = kto_token_data(labels, cu_seqlens, pack["docs"])
    if pack["docs"] and any("vla" in d for d in pack["docs"]):  # robot frames (data/packing/vla.py, models/vla.py)
        from omniweave.data.packing.vla import vla_rows

        extra.update(vla_rows(pack))
    if pack.get("doc_arrays") and "latents" in pack["doc_arrays"][0]:  # video-diffusion clips (diffusion/data.py)
        from omniweave.diffusion.data import diffusion_rows

        extra.update(diffusion_rows(pack))
    if any("loss_weights" in d for d in pack["docs"]):  # fractional per-turn weights (a turn's loss_weight)
        extra.setdefault("token_data", {})["loss_weight"] = pack_loss_weights(pack, int(labels.shape[0]))
    encoded = [m for m in pack["media"] if "same_as" not in m]  # shared items: bytes and features once
    failed = None if skips is None else []
    media = media_batch(proc, [(span_from_record(m), m["bytes"]) for m in encoded], failed)
    if failed:
        skips += media_skip_records(pack, encoded, failed)
    if len(encoded) < len(pack["media"]):
        media.update(shared_feature_rows(pack["media"], int(labels.shape[0])))
    return {**extra,
        "input_ids": torch.from_numpy(pack["input_ids"].astype(np.int64)),  # [L]
        "labels": labels,
        "position_ids": torch.from_numpy(pack["position_ids"].astype(np.int64)),  # [3 or 1, L]
        "cu_seqlens": cu_seqlens,
        **media,
        "num_loss_tokens": int(pack["num_loss_tokens"]),
    }


def pack_loss_weights(pack: dict, length: int) -> torch.Tensor:
    """float32 [L]: each shifted label's weight, 1 but in its document's ``loss_weights`` runs."""
    weights = torch.ones(length, dtype=torch.float32)
    for doc_start, doc in zip(pack["cu_seqlens"][:-1].tolist(), pack["docs"]):
        for start, end, w in doc.get("loss_weights", ()):
            weights[doc_start + start : doc_start + end] = w
    return weights


def media_skip_records(pack: dict, encoded: list[dict], failed: list) -> list[dict]:
    """One record per document whose media did not decode (a reusing document, ``same_as``, with the
    one it reuses): the pack (index, shard), the sample key and id, the token range ``[start, end)``
    of the document in the row, the file (part) and the reason."""
    index = {id(m): i for i, m in enumerate(pack["media"])}
    out, cu = [], pack["cu_seqlens"]
    for k, err in failed:
        bad = index[id(encoded[k])]
        for m in pack["media"]:
            if m is encoded[k] or m.get("same_as") == bad:
                doc = pack["docs"][m["doc"]]
                out.append({"pack": int(pack["index"]), "shard": pack.get("shard"), "sample": doc.get("key"),
                            "id": doc.get("id"), "part": m["part"], "tokens": [int(cu[m["doc"]]), int(cu[m["doc"] + 1])],
                            "reason": err.reason, "message": err.message})
    return out


def shared_feature_rows(media: list[dict], length: int) -> dict:
    """Per modality, ``feature_rows`` [L] of a row whose descriptors reuse earlier ones (``same_as``):
    every item's placeholder runs take its features, a reusing item's runs the features of the item
    it names (encoded once, in ``media_batch``'s order of the other items)."""
    from omniweave.models.registry import MODALITIES, modality_of

    rows = {m.name: torch.full((length,), -1, dtype=torch.int64) for m in MODALITIES}
    counts = dict.fromkeys(rows, 0)
    first: dict[int, int] = {}  # descriptor index -> its first feature
    for i, m in enumerate(media):
        modality = modality_of(m["kind"]).name
        runs = span_from_record(m).ranges()
        if "same_as" in m:
            offset = first[m["same_as"]]
        else:
            offset = first[i] = counts[modality]
            counts[modality] += sum(n for _, n in runs)
        for start, n in runs:
            rows[modality][start : start + n] = torch.arange(offset, offset + n)
            offset += n
    return {m.rows: rows[m.name] for m in MODALITIES if counts[m.name]}


class _PackMap(torch.utils.data.Dataset):
    """Map-style view used by DataLoader workers: pack id -> collated micro-batch."""

    def __init__(self, root: str, data_cfg: dict):
        self.root, self.data_cfg, self._ds = root, data_cfg, None

    def __getitem__(self, i: int) -> dict:
        if self._ds is None:
            self._ds = PackedDataset(self.root)
        skips: list[dict] = []
        return {**collate_pack(self._ds[int(i)], self.data_cfg, skips), SKIPS_KEY: skips}

    def __len__(self) -> int:
        return len(PackedDataset(self.root))


def _as_list(batch: list) -> list:
    return batch


def check_kind(manifest: dict, kind: str, where: str, key: str = "data.path") -> None:
    """SFT packs, RL prompts (``data/packing/prompts.py``), preference pairs (``data/packing/pairs.py``), KTO
    completions (``data/packing/kto.py``) and VLA frames (``data/packing/vla.py``) are not interchangeable."""
    have = manifest.get("kind", "sft")
    if have != kind:
        what = {"sft": "training packs (train.phase sft / pretrain)", "prompts": "RL prompts (train.phase grpo)",
                "pairs": "preference pairs (train.phase dpo / orpo / simpo)", "kto": "KTO completions (train.phase kto)",
                "vla": "robot frames with action chunks (train.phase vla)",
                "diffusion": "video-diffusion clips as latents (train.phase diffusion)"}
        raise UserError(f"{key}={where} holds {what.get(have, have)}, but this run needs {what.get(kind, kind)}; "
                        "pack the data with the recipe of this run (`omniweave data pack … --recipe R`)")


def open_packed(path: str, data_cfg=None, kind: str = "sft", key: str = "data.path",
                where: str | None = None) -> PackedDataset:
    """The packed dataset at ``path`` checked for a run: what it holds (``kind``), the recipe's data
    settings (``data_cfg``) against its fingerprint, and that it has packs; ``key`` / ``where`` name it in errors."""
    dataset = PackedDataset(path)
    check_kind(dataset.manifest, kind, path, key)
    if data_cfg is not None:
        from omniweave.data.text.tokenize import _plain

        cfg = {k: v for k, v in _plain(data_cfg).items() if k not in LOADER_ONLY_KEYS}
        check_fingerprint(dataset.manifest, cfg, where=where or path)
    if len(dataset) == 0:
        raise UserError(f"{where or path}: the packed dataset holds no packs (every sample was dropped at pack: "
                        f"the reasons are in {Path(path) / 'stats.json'}); nothing to train on")
    return dataset


class OneDataset:
    """The loader's source for one packed dataset (``data.path``): epoch e is the permutation
    ``default_rng([seed, e])`` of its packs; a reference is a pack id."""

    def __init__(self, path, seed: int, data_cfg=None, kind: str = "sft"):
        self.path, self.seed = str(path), seed
        self.dataset = open_packed(self.path, data_cfg, kind)
        self.num_packs = self.period = len(self.dataset)
        self.data_cfg = self.dataset.manifest["data_cfg"]  # what built the packs (media processing params)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_packs)}
        return self._orders[epoch]

    def batch(self, epoch: int, cursor: int, count: int) -> tuple[list[int], int, int]:
        """Pack ids of the ``count`` packs starting at (epoch, cursor), and the state after them."""
        ids: list[int] = []
        while len(ids) < count:
            take = min(count - len(ids), self.num_packs - cursor)
            ids += self.order(epoch)[cursor : cursor + take].tolist()
            cursor += take
            if cursor == self.num_packs:
                epoch, cursor = epoch + 1, 0
        return ids, epoch, cursor

    def record(self, ref: int) -> dict:
        return self.dataset.record(ref)

    def pack_map(self, share: bool = True) -> "_PackMap":
        m = _PackMap(self.path, self.data_cfg)
        if share:
            m._ds = self.dataset
        return m

    def state(self, epoch: int, cursor: int) -> dict:
        return {}

    def check_state(self, state: dict) -> None:
        if "mix" in state:
            raise UserError(f"the checkpoint's loader state is of a mix of datasets (data.mix: "
                            f"{', '.join(m['name'] for m in state['mix'])}); this run reads data.path={self.path}: "
                            "resume with the data the run was trained on")


class PackedLoader:
    def __init__(self, path, global_batch: int, dp_rank: int, dp_size: int, seed: int = 0, data_cfg=None,
                 num_workers: int = 0, balance: str | None = None, prefetch_factor: int = 2,
                 cost_model: CostModel | None = None, model_cfg: dict | None = None, kind: str = "sft",
                 mix=None):
        if (path is None) == (mix is None):
            raise ValueError("give the loader one packed dataset (path) or a mix of them (mix): one of the two")
        if mix is not None:  # data.mix: several packed datasets sampled by weight (mix.py)
            from omniweave.data.loading.mix import MixEntry, PackMix, parse_mix

            entries = mix if mix and all(isinstance(e, MixEntry) for e in mix) else parse_mix(mix)
            self.source = self.mix = PackMix(entries, seed, data_cfg, kind)
        else:
            self.source, self.mix = OneDataset(path, seed, data_cfg, kind), None
        self.path, self.dataset = getattr(self.source, "path", None), getattr(self.source, "dataset", None)
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise UserError(f"train.global_batch={global_batch} must be a positive multiple of the data-parallel size "
                            f"{dp_size} (each step's packs are split evenly over the dp ranks)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} not in [0, {dp_size})")
        if balance not in (None, "contiguous", "cost"):
            raise ValueError(f"balance={balance!r}; choose None, 'contiguous' or 'cost'")
        self.global_batch, self.dp_rank, self.dp_size, self.seed = global_batch, dp_rank, dp_size, seed
        self.per_rank = global_batch // dp_size
        self.num_workers, self.balance, self.prefetch_factor = num_workers, balance, prefetch_factor
        self.data_cfg = self.source.data_cfg  # what built the packs (media processing params)
        self.epoch, self.cursor = 0, 0
        self._media_skips: list[dict] = []  # of the batch yielded last (take_media_skips)
        self.batch_sources: list[int] = []  # of the batch yielded last: each micro-batch's dataset of a mix
        if cost_model is None:
            cost_model = CostModel.from_model_config(model_cfg) if model_cfg is not None else CostModel.default()
        self._cost_models: list[tuple[int, CostModel]] = [(0, cost_model)]  # (first stream position, model)
        self._assigned_to = 0  # stream position after the last global batch a share was computed for
        self._stats: dict[int, dict] = {}  # stream position -> balance stats of the batch assigned there

    # ------------------------------------------------------------------ order and state

    @property
    def num_packs(self) -> int:
        return self.source.num_packs

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (a mix: per mix cycle)."""
        return max(1, self.source.period // self.global_batch)

    def describe(self) -> str:
        """The data in a few words, for the line a run starts with."""
        if self.mix is not None:
            return self.mix.describe(self.global_batch)
        return f"{self.num_packs} packs, {self.steps_per_epoch} steps/epoch"

    def order(self, epoch: int) -> np.ndarray:
        return self.source.order(epoch)

    def global_batch_ids(self, epoch: int, cursor: int) -> tuple[list[int], int, int]:
        """Pack ids (references) of the global batch starting at (epoch, cursor), and the state after it."""
        return self.source.batch(epoch, cursor, self.global_batch)

    def position(self, epoch: int, cursor: int) -> int:
        """Packs of the stream before (epoch, cursor): the key of the global batch starting there."""
        return epoch * self.source.period + cursor

    @property
    def cost_model(self) -> CostModel:
        """The model of the next global batch to be assigned."""
        return self._model_at(self._assigned_to)

    def _model_at(self, position: int) -> CostModel:
        return next(cm for start, cm in reversed(self._cost_models) if start <= position)

    def set_cost_model(self, cost_model: CostModel) -> None:
        """Use ``cost_model`` from the first global batch not yet assigned on (call it on every rank)."""
        start = self._assigned_to
        self._cost_models = [(s, cm) for s, cm in self._cost_models if s < start] + [(start, cost_model)]

    def pack_costs(self, ids: list[int], cost_model: CostModel | None = None) -> np.ndarray:
        """Predicted cost of each pack, float64 [len(ids)]."""
        features = np.stack([pack_features(self.source.record(i)) for i in ids])
        return (cost_model or self.cost_model).cost(features)

    def _balanced(self, ids: list[int], cost_model: CostModel) -> tuple[list[list[int]], dict]:
        """(balanced groups of positions, predicted max/mean rank cost contiguous vs balanced)."""
        costs = self.pack_costs(ids, cost_model)
        groups = assign(costs, self.dp_size)
        return groups, {"round_robin": imbalance(costs, round_robin(len(ids), self.dp_size)),
                        "cost": imbalance(costs, groups)}

    def assignment(self, ids: list[int], position: int | None = None) -> list[list[int]]:
        """Every rank's pack ids of one global batch (the same rule on every rank: they agree).
        Balanced by cost, the batch's :meth:`balance_stats` are kept for :meth:`take_balance_stats`."""
        if self.balance != "cost":
            groups = round_robin(len(ids), self.dp_size)
        else:
            groups, stats = self._balanced(ids, self.cost_model if position is None else self._model_at(position))
            if position is not None:
                consumed = self.position(self.epoch, self.cursor)
                self._stats = {p: st for p, st in self._stats.items() if p >= consumed} | {position: stats}
        return [[ids[j] for j in g] for g in groups]

    def rank_share(self, ids: list[int], position: int | None = None) -> list[int]:
        """This rank's packs of the global batch ``ids`` (starting at stream ``position``)."""
        return self.assignment(ids, position)[self.dp_rank]

    def balance_stats(self, ids: list[int]) -> dict:
        """Predicted max/mean rank cost of one global batch, contiguous vs cost-balanced."""
        return self._balanced(ids, self.cost_model)[1]

    def take_balance_stats(self, position: int) -> dict | None:
        """The :meth:`balance_stats` recorded when the global batch starting at stream ``position``
        was assigned (for logging without balancing the batch a second time); None otherwise."""
        return self._stats.pop(position, None)

    def state_dict(self) -> dict:
        here = self.position(self.epoch, self.cursor)
        models = [(s, cm) for s, cm in self._cost_models if s > here]
        models.insert(0, (here, self._model_at(here)))
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_packs": self.num_packs,
                "global_batch": self.global_batch,
                "cost_models": [{"from": s, **cm.to_dict()} for s, cm in models],
                **self.source.state(self.epoch, self.cursor)}

    def load_state_dict(self, state: dict) -> None:
        self.source.check_state(state)
        if state.get("num_packs", self.num_packs) != self.num_packs:
            raise UserError(f"the checkpoint's loader state is for a dataset of {state['num_packs']} packs, "
                            f"{self.path} has {self.num_packs}: resume on the data the run was trained on")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this loader seed {self.seed}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._assigned_to = self.position(self.epoch, self.cursor)
        if "cost_models" in state:
            self._cost_models = [(int(d["from"]), CostModel.from_dict(d)) for d in state["cost_models"]]

    # ------------------------------------------------------------------ iteration

    def iter_pack_ids(self) -> Iterator[list[int]]:
        """This rank's pack ids per step, from the current state on; advances the state."""
        for share in self._shares_from(self.epoch, self.cursor):
            _, self.epoch, self.cursor = self.global_batch_ids(self.epoch, self.cursor)
            yield share

    def _shares_from(self, epoch: int, cursor: int) -> Iterator[list[int]]:
        while True:
            start = self.position(epoch, cursor)
            ids, epoch, cursor = self.global_batch_ids(epoch, cursor)
            self._assigned_to = max(self._assigned_to, self.position(epoch, cursor))
            yield self.rank_share(ids, start)

    def __iter__(self) -> Iterator[list[dict]]:
        """This rank's micro-batches per step. A sample whose media do not decode does not stop the
        run: its media are zeros and :meth:`take_media_skips` names it (the trainer takes its loss off)."""
        epoch, cursor = self.epoch, self.cursor
        if self.num_workers <= 0:
            pack_map = self.source.pack_map(share=True)
            batches = ([pack_map[i] for i in share] for share in self._shares_from(epoch, cursor))
        else:
            batches = torch.utils.data.DataLoader(
                self.source.pack_map(share=False), batch_sampler=self._shares_from(epoch, cursor),
                num_workers=self.num_workers, collate_fn=_as_list, prefetch_factor=self.prefetch_factor,
            )
        for batch in batches:
            _, self.epoch, self.cursor = self.global_batch_ids(self.epoch, self.cursor)
            self._media_skips = [{"row": j, **rec} for j, mb in enumerate(batch) for rec in mb.pop(SKIPS_KEY)]
            self.batch_sources = [mb.pop(SOURCE_KEY, 0) for mb in batch]
            yield batch

    def take_media_skips(self) -> list[dict]:
        """The skip records of the batch :meth:`__iter__` yielded last (``collate_pack``), each with
        ``row``: which of this rank's micro-batches holds the document; emptied by the call."""
        skips, self._media_skips = self._media_skips, []
        return skips
