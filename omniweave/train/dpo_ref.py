"""``omniweave dpo precompute-ref R.yaml [key=value …] [--output FILE]``: DPO reference log-probs, once, offline.

``train.dpo.ref: precomputed`` (train/dpo.py) reads each pair's reference sequence log-probs
from a file instead of running a reference model in every step (TRL's ``precompute_ref_log_probs``):
no second model in memory, no second forward pass. This command writes that file: the recipe's
model initialised exactly as its training run initialises the policy (``train.seed``, or
``train.init_from``; train/parallel_model.build on one process), run over every pack of ``data.path``
under the run's ``train.precision``. Default file: ``<data.path>/ref_logps.npz``
(``train.dpo.ref_path`` / ``--output`` elsewhere). Written to a temporary name and renamed, so a
crash leaves the previous file or none, never a partial one.

The ``.npz`` (no pickle) holds, for N packs of P pairs in all:

    logps       float32 [P, 2]   (chosen, rejected) reference sequence log-probs, pack by pack
    offsets     int64 [N + 1]    pack i's pairs are rows offsets[i]:offsets[i+1]
    pair_index  int64 [P]        each pair's source sample index (the pack records' docs)
    identity    JSON string      the reference: ``model`` (the recipe's model section but the
                                 keys that do not change it: NOT_REFERENCE_KEYS), ``init``
                                 ({"init_from": absolute path, "weights": the size and mtime of
                                 each weight file} or {"seed": s}), ``precision``

A training run checks the file against its data (pack count, pairs per pack, their samples) and
its recipe (model section, init) before the first step and names what differs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from omniweave.config import section
from omniweave.errors import UserError

DEFAULT_NAME = "ref_logps.npz"
FORMAT = "omniweave-dpo-ref/1"
# a component's keys that leave the initial policy's log-probs as they are: what trains (freeze,
# LoRA adapters, which start as a no-op), the layout (tp) and the attention kernel
NOT_REFERENCE_KEYS = ("freeze", "lora", "tp", "attn_backend")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="the DPO recipe (YAML path or built-in name) the training run will use")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides, as for `omniweave train`")
    p.add_argument("--output", default=None,
                   help=f"file to write (default: train.dpo.ref_path, else <data.path>/{DEFAULT_NAME})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe
    from omniweave.train.trainer import check_ready

    cfg = load_recipe(args.recipe, args.overrides)
    if section(cfg, "train").phase != "dpo":
        raise UserError(f"train.phase={section(cfg, 'train').phase!r}: reference log-probs are for train.phase=dpo")
    if section(cfg, "data").mix is not None:
        raise UserError("omniweave dpo precompute-ref stores the reference log-probs of one packed dataset (data.path), "
                        "not of a data.mix yet")
    check_ready(cfg, None, kind="pairs")
    path = Path(args.output) if args.output else ref_path(cfg)
    n = precompute(cfg, path, progress=not args.no_progress)
    print(f"reference log-probs of {n} pairs written to {path}; train with train.dpo.ref=precomputed"
          + (f" train.dpo.ref_path={path}" if args.output else ""))
    return 0


def ref_path(cfg) -> Path:
    """``train.dpo.ref_path``, else ``<data.path>/ref_logps.npz``."""
    given = section(cfg, "train").dpo.ref_path
    return Path(given) if given else Path(cfg.data.path) / DEFAULT_NAME


def identity(cfg) -> dict:
    """What the stored values depend on besides the data: the model (its components' keys but
    ``NOT_REFERENCE_KEYS``) and how it is initialised."""
    from omniweave.config import to_dict

    init = section(cfg, "train").init_from
    model = {name: {k: v for k, v in c.items() if k not in NOT_REFERENCE_KEYS} if isinstance(c, dict) else c
             for name, c in to_dict(cfg.model).items()}
    return {"model": model,
            "init": {"init_from": str(Path(init).resolve()), "weights": weights_stamp(init)} if init
            else {"seed": int(cfg.train.seed)},
            "precision": section(cfg, "train").precision}


def weights_stamp(path) -> str:
    """The files ``train.init_from`` reads, each with its size and modification time (what ``make``
    trusts; reading every weight to hash it would cost a pass over the model): a directory whose
    weights were replaced in place no longer matches the stored values."""
    from omniweave.train import checkpoint

    root = Path(path)
    if (root / "config.json").is_file():  # a HF directory
        files = sorted([root / "config.json", *root.glob("*.safetensors")])
    else:  # an omniweave checkpoint: DCP's metadata and shards
        try:
            step = checkpoint.resolve_checkpoint(path)
        except FileNotFoundError:  # nothing to read: loading the weights says so, naming the key
            return "missing"
        files = sorted(f for f in step.iterdir() if f.is_file())
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def pair_layout(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [N + 1], pair_index [P]) of a pairs dataset from its pack records."""
    counts = [len(r["docs"]) // 2 for r in records]
    index = [int(d["index"]) for r in records for d in r["docs"][::2]]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), np.asarray(index, np.int64)


@torch.no_grad()
def precompute(cfg, path: Path, progress: bool = True) -> int:
    """Write the reference log-probs of every pair of ``data.path`` to ``path``; returns the pair
    count."""
    from omniweave.train.engine import with_process_group

    return with_process_group(lambda: _precompute(cfg, Path(path), progress))


def _precompute(cfg, path: Path, progress: bool) -> int:
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.dpo import sequence_logps
    from omniweave.train.engine import autocast, join_process, to_device
    from omniweave.train.parallel_model import build

    _, _, world, device = join_process(cfg)  # the engine's own start: device, process group, threads
    if world > 1:
        raise UserError("`omniweave dpo precompute-ref` runs on one process (no --nproc / torchrun)")
    dims = ParallelDims.from_config(None, 1)  # one process: the layout keys (parallel.*, model.*.tp) do not apply
    model = build(cfg, device, dims, dims.build_meshes(device.type)).eval()  # the policy's initial weights
    data_cfg = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in LOADER_ONLY_KEYS}
    ds = PackedDataset(cfg.data.path)
    offsets, pair_index = pair_layout([ds.record(i) for i in range(len(ds))])
    logps = np.zeros((int(offsets[-1]), 2), np.float32)
    precision = section(cfg, "train").precision
    for i in tqdm(range(len(ds)), desc="reference log-probs", unit="pack", disable=None if progress else True):  # a terminal only
        mb = to_device(collate_pack(ds[i], data_cfg), device)
        with autocast(device, precision, False):
            tokens = model(mb, token_logprobs=True).token_logp
        logps[offsets[i] : offsets[i + 1]] = sequence_logps(tokens, mb["token_data"]["pair_slot"],
                                                            int(mb["num_pairs"])).cpu().numpy()
    _atomic_savez(path, logps=logps, offsets=offsets, pair_index=pair_index,
                  identity=np.array(json.dumps({"format": FORMAT, **identity(cfg)}, sort_keys=True)))
    return int(offsets[-1])


def _atomic_savez(path: Path, **arrays) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class StoredReference:
    """The precomputed reference log-probs of a run's pairs, checked against its recipe and data:
    ``pack(i)`` -> float32 [pairs of pack i, 2]."""

    def __init__(self, cfg):
        from omniweave.data.packing.packed import PackedDataset

        self.path = path = ref_path(cfg)
        if not path.is_file():
            raise UserError(f"train.dpo.ref=precomputed: no reference log-probs at {path} (train.dpo.ref_path, "
                            f"default <data.path>/{DEFAULT_NAME}); write them with `omniweave dpo precompute-ref "
                            "RECIPE [the run's overrides]`")
        with np.load(path, allow_pickle=False) as z:
            self.logps, self.offsets, pair_index = z["logps"], z["offsets"], z["pair_index"]
            stored = json.loads(str(z["identity"]))
        self._check_identity(stored, identity(cfg))
        ds = PackedDataset(cfg.data.path)
        offsets, want_index = pair_layout([ds.record(i) for i in range(len(ds))])
        where = f"train.dpo.ref_path={path} was computed for other data than data.path={cfg.data.path}"
        if len(offsets) != len(self.offsets):
            raise UserError(f"{where}: {len(self.offsets) - 1} packs stored, the data has {len(offsets) - 1}; "
                            "recompute it (`omniweave dpo precompute-ref`)")
        if not np.array_equal(offsets, self.offsets) or not np.array_equal(want_index, pair_index):
            bad = int(np.flatnonzero(np.diff(offsets) != np.diff(self.offsets))[0]) if not np.array_equal(
                offsets, self.offsets) else int(np.searchsorted(offsets, np.flatnonzero(want_index != pair_index)[0],
                                                                side="right") - 1)
            raise UserError(f"{where}: pack {bad} holds other pairs ({int(self.offsets[bad + 1] - self.offsets[bad])} "
                            f"stored, {int(offsets[bad + 1] - offsets[bad])} in the data, or other samples); "
                            "recompute it (`omniweave dpo precompute-ref`)")

    def _check_identity(self, stored: dict, wanted: dict) -> None:
        from omniweave.data.packing.packed import fingerprint_diff

        if stored.get("format") != FORMAT:
            raise UserError(f"train.dpo.ref_path={self.path}: format {stored.get('format')!r}, expected {FORMAT!r}")
        diffs = fingerprint_diff(stored["model"], wanted["model"], "model")
        if stored["init"] != wanted["init"]:
            (sk, sv), (wk, wv) = next(iter(stored["init"].items())), next(iter(wanted["init"].items()))
            if (sk, sv) == (wk, wv):  # the same train.init_from, other weights in it
                diffs.append(f"train.init_from={sv!r}: " + ("its weight files changed since the values were stored"
                             if "weights" in stored["init"] else "stored without its weight files' sizes and times "
                             "(an older omniweave)"))
            else:
                diffs.append(f"train.{sk}={sv!r} stored" + (f", now {wv!r}" if sk == wk else f", now train.{wk}={wv!r}"))
        if diffs:
            raise UserError(f"train.dpo.ref_path={self.path} holds another reference model's log-probs; recompute "
                            "them with this recipe (`omniweave dpo precompute-ref`) or fix the recipe: "
                            + "; ".join(d.replace("packed with", "stored") for d in diffs))

    def pack(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.logps[self.offsets[i] : self.offsets[i + 1]])
