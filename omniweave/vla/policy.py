"""A trained VLA checkpoint as a policy: observations in, action chunks out (unnormalised).

    policy = Policy.load("runs/demo_vla/run")           # the latest checkpoint of a run (or a checkpoint dir)
    chunk = policy({"images": {"observation.images.top": rgb_uint8},
                    "state": np.array([0.3, 0.7]), "task": "reach the red target"})   # [H, action_dim]

Each call builds the rows exactly as ``data pack`` built the training rows (the same prompt,
``data/packing/vla.observation_sample``; the same image processing, the loader's ``media_batch``),
computes the prefix once and integrates the expert's velocity in ``num_steps`` Euler steps
(``VLAModel.sample_actions``), then undoes the action normalisation with the statistics the
training data was packed with (``lerobot_stats.json`` in the packed dataset, or ``stats=``).
Several observations go in one row (``sample``), each its own document with its own chunk.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from omniweave.data.packing.vla import STATS_FILE, VLASettings, observation_sample, read_stats
from omniweave.data.sources.lerobot import normalize, unnormalize
from omniweave.errors import UserError


def png_bytes(rgb: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.asarray(rgb, np.uint8)).save(out, format="PNG")
    return out.getvalue()


class Policy:
    def __init__(self, model, cfg: dict, stats: dict, seed: int = 0):
        from omniweave.data.text.tokenize import SampleProcessor

        self.model = model.eval()
        self.data_cfg = {k: v for k, v in cfg["data"].items() if k not in ("path", "mix", "num_workers", "balance",
                                                                           "balance_refit")}
        if getattr(model, "action_expert", None) is None:
            raise UserError("this checkpoint's model has no action_expert: not a VLA run")
        self.proc = SampleProcessor(self.data_cfg)
        self.settings: VLASettings = self.proc.vla
        self.stats = stats
        self.cameras = list(self.settings.cameras if self.settings.cameras is not None else stats["cameras"])
        expert = model.action_expert.config
        self.horizon, self.width, self.action_dim = expert.horizon, expert.action_dim, int(stats["action_dim"])
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def load(cls, path: str | Path, stats: str | Path | None = None, seed: int = 0) -> "Policy":
        """The checkpoint at ``path`` (a run dir: its latest), its recipe from the checkpoint's
        config.yaml, the statistics from ``stats`` (a lerobot_stats.json or a directory holding one)
        or else from the packed dataset the run trained on."""
        import yaml

        from omniweave.train.checkpoint import load_model, resolve_checkpoint

        ckpt = resolve_checkpoint(path)
        cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
        model, _ = load_model(ckpt, cfg["model"])
        where = Path(stats) if stats is not None else Path(str(cfg["data"].get("path") or ""))
        if where.is_file():
            where = where.parent
        if not (where / STATS_FILE).is_file():
            raise UserError(f"no {STATS_FILE} in {where}: pass the statistics the run was packed with (--stats)")
        return cls(model, cfg, read_stats(str(where)), seed)

    def rows(self, observations: list[dict]) -> dict:
        """One row of the observations' prefixes (documents in order) with their chunks' keys, made
        by the loader's own collate from an in-memory pack."""
        from omniweave.data.loading.loader import collate_pack
        from omniweave.data.packing.packed import media_descriptor, pack_arrays

        samples, images = [], []
        for i, obs in enumerate(observations):
            missing = [c for c in self.cameras if c not in obs["images"]]
            if missing:
                raise UserError(f"observation {i} lacks camera(s) {missing}; the policy reads {self.cameras}")
            images.append({c: png_bytes(obs["images"][c]) for c in self.cameras})
            state = normalize(np.asarray(obs["state"], np.float64), self.stats["state"])
            samples.append(self.proc.tokenize_prompt(
                observation_sample(f"obs{i}", images[-1], state, obs["task"], self.settings)))
        pack = pack_arrays(samples)
        starts = pack["cu_seqlens"][:-1].tolist()
        pack["media"] = [{**media_descriptor(span, d, d, starts[d]), "bytes": images[d][span.part]}
                         for d, s in enumerate(samples) for span in s.media]
        pack.update(docs=[{"id": s.id, "index": d} for d, s in enumerate(samples)], num_loss_tokens=0, index=0)
        return {**collate_pack(pack, self.data_cfg), "prefix_lens": torch.tensor([len(s) for s in samples]),
                "action_docs": torch.arange(len(samples))}

    @torch.no_grad()
    def sample(self, observations: list[dict], num_steps: int | None = None) -> list[np.ndarray]:
        """Each observation's action chunk [H, action_dim] in the dataset's units."""
        batch = self.rows(observations)
        noise = torch.randn(len(observations), self.horizon, self.width, generator=self.generator)
        dtype = next(self.model.parameters()).dtype
        chunks = self.model.sample_actions(batch, noise.to(dtype), num_steps).float().numpy()
        return [unnormalize(c[:, :self.action_dim].astype(np.float64), self.stats["action"]) for c in chunks]

    def __call__(self, observation: dict) -> np.ndarray:
        return self.sample([observation])[0]

