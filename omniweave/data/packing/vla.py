"""VLA frames: what ``omniweave data pack`` stores when the recipe's ``train.phase`` is ``vla``.

The input is a LeRobot conversion (``data convert --format lerobot``: one ``vla.json`` per frame,
the videos it references, ``lerobot_stats.json``). Each frame becomes one document:

    <image> per camera + the prompt   e.g. "Task: pick up the cube, State: 131 87 140;\\nAction: "
                                      rendered by the recipe's chat template as a user turn plus the
                                      assistant header, every token bidirectional (prefix_len = all)
    action chunk                      [H, A] normalised (quantiles: 2 (x − q01) / (q99 − q01) − 1),
                                      stored as float32 beside the pack's media, with its padding flags

The state goes into the prompt as Pi0.5 writes it: normalised, then ``np.digitize`` into
``data.vla.state_bins`` bins over [−1, 1] (bin −1 below −1, ``bins − 1`` above, as openpi's copy
does, no clipping); ``state_bins: 0`` leaves it out (and ``{state}`` must then leave the prompt).
Pi0.5 zero-pads the state to 32 dims first; here the dataset's own dims are written.

Discrete action tokens (``data.vla.action_bins`` > 0; Pi0.5's and knowledge insulation's
co-training signal for the backbone, FAST tokens there, plain bins here): the chunk's normalised
unpadded actions, digitized like the state, become the assistant's answer after the prompt. The
answer is the document's causal tail with loss labels (``train.vla.text_weight`` weighs it); the
prefix ends where the labels start, so the action expert never sees it. At sampling time the prompt
alone is the document (vla/policy.py), with the same prefix tokens.

Camera frames are decoded from the referenced videos at their timestamps (lerobot's rule: the
frame nearest in time, within ``TOLERANCE_S``) and stored in the pack as PNG (lossless: the
pixels the loader decodes equal the video decoder's), so training never seeks in a video. A frame
that cannot be decoded, a camera the sample lacks, a prompt over ``data.max_len``: counted drops
with their reasons, like every other pack reject.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from omniweave.data.packing.prompts import KIND_VLA
from omniweave.data.packing.video_frames import FrameReader
from omniweave.data.sample import IMAGE_PLACEHOLDER, Conversation, Message, RawSample
from omniweave.data.sources.lerobot import normalize
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from omniweave.errors import UserError

STATS_FILE = "lerobot_stats.json"


@dataclass(frozen=True)
class VLASettings:
    """``data.vla``: how a frame becomes a prompt (part of the packs' fingerprint)."""

    prompt: str = "Task: {task}, State: {state};\nAction: "
    state_bins: int = 256  # 0: no state tokens
    action_bins: int = 0  # > 0: the chunk as discrete action tokens, the answer the backbone learns (co-training)
    cameras: tuple[str, ...] | None = None  # which cameras, in this order (None: the dataset's, all)

    @classmethod
    def from_mapping(cls, cfg: dict | None) -> "VLASettings":
        cfg = {k: v for k, v in dict(cfg or {}).items() if v is not None or k != "cameras"}
        fields = ("prompt", "state_bins", "action_bins", "cameras")
        unknown = sorted(set(cfg) - set(fields))
        if unknown:
            raise UserError(f"data.vla: unknown key(s) {unknown}; valid: {', '.join(fields)}")
        if cfg.get("cameras") is not None:
            cfg["cameras"] = tuple(cfg["cameras"])
        settings = cls(**cfg)
        if settings.state_bins < 0 or settings.action_bins < 0:
            raise UserError(f"data.vla.state_bins / action_bins must be >= 0, got {settings.state_bins} / "
                            f"{settings.action_bins}")
        if "{task}" not in settings.prompt:
            raise UserError(f"data.vla.prompt {settings.prompt!r} must hold {{task}}")
        if ("{state}" in settings.prompt) != (settings.state_bins > 0):
            raise UserError("data.vla: the prompt holds {state} exactly when state_bins > 0")
        return settings

    def spec(self) -> dict:
        return {"prompt": self.prompt, "state_bins": self.state_bins, "action_bins": self.action_bins,
                "cameras": list(self.cameras) if self.cameras is not None else None}


def state_tokens(state: np.ndarray, bins: int) -> str:
    """Pi0.5's discretised state: ``digitize(state, linspace(−1, 1, bins + 1)[:-1]) − 1`` as
    space-separated ints (no clipping: below −1 is −1, above 1 is ``bins − 1``)."""
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    return " ".join(str(int(b)) for b in np.digitize(np.asarray(state, np.float64), edges) - 1)


@lru_cache(maxsize=8)
def read_stats(root: str) -> dict:
    path = Path(root) / STATS_FILE
    if not path.is_file():
        raise UserError(f"{root}: no {STATS_FILE}; a VLA recipe packs the output of "
                        "`omniweave data convert --format lerobot`")
    stats = json.loads(path.read_text())
    for key in ("state", "action"):
        stats[key] = {k: np.asarray(v, np.float64) for k, v in stats[key].items()}
    return stats


class VLARawDataset:
    """A LeRobot conversion read as RawSamples: each frame's observation as a one-turn
    conversation (its camera frames as the images), its normalised action chunk in ``meta``."""

    def __init__(self, root: str | Path, settings: VLASettings):
        from omniweave.data.sources.shards import RawDataset

        self.root, self.settings = Path(root), settings
        self.raw = RawDataset(root)
        self.stats = read_stats(str(root))
        self.cameras = list(settings.cameras if settings.cameras is not None else self.stats["cameras"])
        self._frames = None  # this process's FrameReader (open videos do not travel to workers)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_frames": None}

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> RawSample:
        from omniweave.data.sources.shards import parse_sample_bytes

        key, parts = parse_sample_bytes(self.raw.read_bytes(i))
        if "vla.json" not in parts:
            raise SampleRejected("not_a_vla_sample", f"sample {key} has no vla.json (a conversation shard?)")
        frame = json.loads(parts["vla.json"])
        images = {}
        for camera in self.cameras:
            ref = frame["cameras"].get(camera)
            if ref is None:
                raise SampleRejected("missing_camera", f"sample {key} has no {camera}")
            if self._frames is None:
                self._frames = FrameReader()
            images[camera] = self._frames.png(self.root / ref["file"], float(ref["timestamp"]))
        state = normalize(np.asarray(frame["state"], np.float64), self.stats["state"])
        actions = normalize(np.asarray(frame["actions"], np.float64), self.stats["action"]).astype(np.float32)
        is_pad = [bool(p) for p in frame["action_is_pad"]]
        meta = {"vla": {"actions": actions, "is_pad": is_pad, "frame": int(frame["index"])}}
        answer = None
        if self.settings.action_bins:  # the unpadded steps, digitized: the backbone's co-training answer
            answer = state_tokens(actions[~np.asarray(is_pad)].reshape(-1), self.settings.action_bins)
        return observation_sample(key, images, state, frame["task"], self.settings, meta, answer)


def observation_sample(key: str, images: dict[str, bytes], state: np.ndarray, task: str, settings: VLASettings,
                       meta: dict | None = None, answer: str | None = None) -> RawSample:
    """One observation as a one-turn conversation: an ``<image>`` per camera (``images``, encoded
    files in camera order), then ``settings.prompt`` with the task and the normalised ``state``
    discretised; ``answer`` (discrete action tokens) as the assistant's turn. Packing and the
    policy (vla/policy.py) build their prompts here, so they agree."""
    fields = {"task": str(task).replace("_", " ").strip()}
    if settings.state_bins:
        fields["state"] = state_tokens(state, settings.state_bins)
    text = IMAGE_PLACEHOLDER * len(images) + settings.prompt.format(**fields)
    messages = [Message("user", text)] + ([Message("assistant", answer)] if answer is not None else [])
    return RawSample(key, Conversation(id=key, messages=messages, images=list(images), meta=dict(meta or {})),
                     dict(images))


def tokenize_vla(proc: SampleProcessor, raw: RawSample) -> list[tuple]:
    """[(the frame's document, its doc info)]: the observation as a generation prompt, all of it
    the bidirectional prefix, or, with an answer (discrete action tokens), the prompt as the prefix
    and the labelled answer as the causal tail; the action chunk as a float32 array of the pack."""
    answered = any(m.role == "assistant" for m in raw.conversation.messages)
    sample = proc.tokenize(raw) if answered else proc.tokenize_prompt(raw, bounded=True)
    if len(sample) > proc.max_len or sample.truncated:
        raise SampleRejected("too_long", f"the observation takes {len(sample)} tokens > data.max_len {proc.max_len}")
    labelled = np.flatnonzero(sample.labels != -100)
    prefix_len = int(labelled[0]) if len(labelled) else len(sample)
    vla = raw.conversation.meta["vla"]
    return [(sample, {"vla": {"is_pad": vla["is_pad"], "frame": vla["frame"], "prefix_len": prefix_len},
                      "arrays": {"actions": vla["actions"]}})]


def raw_kind(root: str | Path) -> str:
    """``vla`` for a LeRobot conversion, else ``conversation`` (convert_report.json's kind)."""
    report = Path(root) / "convert_report.json"
    if report.is_file():
        return json.loads(report.read_text()).get("kind", "conversation")
    return KIND_VLA if (Path(root) / STATS_FILE).is_file() else "conversation"


def check_raw_kind(root: str | Path, kind: str) -> None:
    """A VLA recipe packs LeRobot conversions only, a diffusion recipe clips conversions only, every
    other recipe conversations only."""
    have = raw_kind(root)
    if (kind == "diffusion") != (have == "clips"):
        if kind == "diffusion":
            raise UserError(f"--input {root} holds {'robot frames' if have == KIND_VLA else 'conversations'}; "
                            "train.phase=diffusion packs a clips conversion (`omniweave data convert --format clips`)")
        raise UserError(f"--input {root} holds video clips (a clips conversion); pack it with a diffusion recipe "
                        "(train.phase: diffusion, e.g. `--recipe demo_diffusion`)")
    if (kind == KIND_VLA) != (have == KIND_VLA):
        if kind == KIND_VLA:
            raise UserError(f"--input {root} holds conversations; train.phase=vla packs a LeRobot conversion "
                            "(`omniweave data convert --format lerobot`)")
        raise UserError(f"--input {root} holds robot frames (a LeRobot conversion); pack it with a VLA recipe "
                        "(train.phase: vla, e.g. `--recipe demo_vla`)")


def vla_rows(pack: dict) -> dict:
    """A pack's VLA keys (models/vla.py): ``prefix_lens [D]`` of every document (0: a causal text
    document) and, per frame document, its chunk: ``action_docs [N]``, ``actions [N, H, a]``,
    ``action_is_pad [N, H]``, ``action_dims [N]`` and ``action_samples [N]`` (the raw sample
    index, which seeds the chunk's flow draw), plus ``num_action_values`` (unpadded steps × a)."""
    import torch

    frames = [(d, doc) for d, doc in enumerate(pack["docs"]) if "vla" in doc]
    if not frames:
        return {}
    actions = [np.asarray(pack["doc_arrays"][d]["actions"], np.float32) for d, _ in frames]
    if len({a.shape for a in actions}) != 1:
        raise ValueError(f"pack {pack.get('index')}: action chunks of different shapes {sorted({a.shape for a in actions})}")
    is_pad = torch.tensor([doc["vla"]["is_pad"] for _, doc in frames], dtype=torch.bool)
    dims = torch.full((len(frames),), actions[0].shape[1], dtype=torch.int64)
    return {
        "prefix_lens": torch.tensor([doc.get("vla", {}).get("prefix_len", 0) for doc in pack["docs"]], dtype=torch.int64),
        "action_docs": torch.tensor([d for d, _ in frames], dtype=torch.int64),
        "actions": torch.from_numpy(np.stack(actions)),
        "action_is_pad": is_pad,
        "action_dims": dims,
        "action_samples": torch.tensor([int(doc["index"]) for _, doc in frames], dtype=torch.int64),
        "num_action_values": int(((~is_pad).sum(1) * dims).sum()),
    }
