"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, atomic, resumable.

    RUN/checkpoints/
      step_000200/            complete checkpoint (DCP files + the rest below)
        .metadata  __0_0.distcp …   model + optimizer, each rank writes its own shards
        trainer_state.json    step, scheduler, loader (epoch, cursor), counters
        rng_rank{r}.pt        each rank's torch RNG state
        config.yaml           the full recipe (``omniweave hf export`` rebuilds the model from it)
        checksums.json        SHA-256 and size of every file above, verified before loading
      latest -> step_000200   symlink, replaced atomically only after the directory is complete
      .tmp-step_000300/       a save in progress (or killed): never read, removed on the next save

A save writes into ``.tmp-step_N``, renames it to ``step_N`` when every rank has finished, and
only then moves ``latest``; so a run killed at any moment leaves either the previous checkpoint
or the new one, never a half one that looks whole. ``keep_last`` prunes older complete ones.
``train.async_save`` writes in the background and publishes the same way once every rank's
write is done (:class:`Checkpointer`). Loading reads no pickle that could run code and verifies the
checksums first (checkpoint_io.py); ``--resume auto`` passes over a damaged checkpoint to the newest
one that verifies, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from omniweave.errors import UserError
from omniweave.train import checkpoint_io

STEP_DIR = re.compile(r"^step_(\d+)$")
FAULT_ENV = "OMNIWEAVE_FAULT_IN_SAVE"  # tests: SIGKILL rank 0 mid-save at this step
SLOW_WRITE_ENV = "OMNIWEAVE_SLOW_ASYNC_SAVE"  # tests: an asynchronous save's writer waits this many seconds first


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").exists() and (path / "trainer_state.json").exists()


def complete_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``ckpt_root``, newest first (``latest`` first if it is whole)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    found = [p for _, p in steps if is_complete(p)]
    latest = root / "latest"
    if latest.is_symlink() and is_complete(latest.resolve()):
        found = [latest.resolve(), *(p for p in found if p != latest.resolve())]
    return found


def find_latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint: ``latest`` if it is whole, else the highest complete step."""
    found = complete_checkpoints(ckpt_root)
    return found[0] if found else None


def newest_undamaged(ckpt_root: str | os.PathLike, say=print) -> Path | None:
    """Collective: ``--resume auto``'s checkpoint, the newest complete one whose files match their
    checksums; each damaged one passed over is ``say``-ed. None when there is none at all; a
    ``CheckpointDamaged`` naming them when every one is damaged."""
    found, damaged = complete_checkpoints(ckpt_root), []
    for ckpt in found:
        problem = checkpoint_io.find_damage(ckpt)
        if problem is None:
            if damaged:
                say(f"--resume auto: passed over {len(damaged)} damaged checkpoint(s) ({damaged[0]}); "
                    f"resuming from {ckpt.name}")
            return ckpt
        damaged.append(problem)
    if damaged:
        raise checkpoint_io.CheckpointDamaged("--resume auto: every checkpoint is damaged: " + "; ".join(damaged))
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir from: a checkpoint dir, a ``checkpoints/`` dir, or a run dir."""
    p = Path(path)
    if is_complete(p.resolve()):
        return p.resolve()
    for root in (p, p / "checkpoints"):
        found = find_latest(root)
        if found is not None:
            return found
    raise FileNotFoundError(f"{p}: no complete checkpoint (expected .metadata + trainer_state.json)")


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, flat_optim: bool = True) -> dict[str, Any]:
    """The model's (and optimizer's) DCP state. ``flat_optim``: the optimizer's hyperparameters
    per parameter name (``param_groups.<name>.lr``), not as lists of groups naming their
    parameters: pipeline ranks hold different parameters, and a group's parameter list saved by
    one of them would not name the parameters another layout's ranks hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat_optim))
    return {"model": msd, "optim": osd}


def _flat_optim(path: Path) -> bool:
    """Whether the checkpoint's optimizer hyperparameters are per parameter (older checkpoints
    saved lists of groups)."""
    return "optim.param_groups.0.params" not in checkpoint_io.read_metadata(path).state_dict_metadata


def _group_names_missing(path: Path, optim_state: dict) -> dict[str, Any]:
    """The (flat) optimizer state's group names (``param_groups.<param>.component``: per-component
    groups, train/optim.py) that checkpoint ``path`` lacks, taken out of ``optim_state`` to be put
    back after DCP loads the rest: a run may add ``model.<component>.lr`` at resume (resume_keys.py),
    and a group's name is the recipe's to decide, not something the run learned."""
    from omniweave.train.optim import GROUP_NAME

    saved = checkpoint_io.read_metadata(path).state_dict_metadata
    missing = [k for k in optim_state if k.startswith("param_groups.") and k.endswith(f".{GROUP_NAME}")
               and f"optim.{k}" not in saved]
    return {k: optim_state.pop(k) for k in missing}


def _family_differences(path: Path, model_cfg) -> list[str]:
    """Components whose ``name`` / ``family`` differ between the checkpoint's recipe and ``model_cfg``."""
    import yaml

    from omniweave.config import to_dict

    saved = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model") or {}
    out = []
    for comp, mine in to_dict(model_cfg).items():
        theirs = saved.get(comp)
        if not isinstance(mine, dict) or not isinstance(theirs, dict):
            continue
        for key in ("name", "family"):
            if key in theirs and theirs.get(key) != mine.get(key):
                out.append(f"model.{comp}.{key}: checkpoint {theirs.get(key)!r}, recipe {mine.get(key)!r}")
    return out


def _all_ranks_names(names: set[str]) -> set[str]:
    """The union of every rank's parameter names (a pipeline rank holds some of the model's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return names
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(names))
    return set().union(*map(set, everyone))


def _listed(label: str, items: list[str]) -> str:
    from omniweave.errors import first_few

    return f"{label}: {first_few(items, 4)}"


def check_fits(path: str | os.PathLike, model_state: dict[str, Any], model_cfg=None, fresh: set[str] = frozenset(),
               collective: bool = True) -> None:
    """Refuse in one line, before DCP reads anything, a checkpoint that does not hold the recipe's
    model: another family, a tensor one has and the other lacks (q/k/v biases, LoRA adapters, a
    component), another shape (``num_experts``, vocabulary, width). ``fresh``: names the recipe
    may lack in the checkpoint (adapters ``init_from`` starts fresh). ``collective``: every rank
    calls it (``model_state`` is this rank's part under pipeline parallelism)."""

    path = Path(path)
    saved = {k[len("model."):]: m for k, m in checkpoint_io.read_metadata(path).state_dict_metadata.items()
             if k.startswith("model.")}
    problems = _family_differences(path, model_cfg) if model_cfg is not None else []
    missing = sorted(n for n in model_state if n not in saved and n not in fresh)
    mine = _all_ranks_names(set(model_state)) if collective else set(model_state)
    extra = sorted(n for n in saved if n not in mine)
    wrong = [f"{name}: checkpoint {list(saved[name].size)}, recipe {list(t.shape)}"
             for name, t in model_state.items()
             if isinstance(t, torch.Tensor) and hasattr(saved.get(name), "size") and tuple(saved[name].size) != tuple(t.shape)]
    if missing:
        problems.append(_listed("the recipe's model has, the checkpoint lacks", missing))
    if extra:
        problems.append(_listed("the checkpoint has, the recipe's model lacks", extra))
    if wrong:
        problems.append(_listed("other shapes", wrong))
    if problems:
        hint = (" — the MoE layers' expert count (model.foundation.num_experts) differs"
                if any(".experts." in w or ".gate." in w for w in wrong) else "")
        raise UserError(f"checkpoint {path} does not fit the recipe's model{hint}: " + "; ".join(problems))


class Checkpointer:
    """The saves of one run (collective: every rank calls each method).

    ``save`` writes ``step_N`` as the module doc says. With ``async_save`` (``train.async_save``)
    DCP stages this rank's shards to host memory, training goes on while a background thread
    writes them (over a gloo group of its own, as DCP asks), and the checkpoint is published —
    trainer state, rename, ``latest`` — only once every rank's write has finished: ``poll`` after
    each step publishes it when all are done, ``wait`` (the next save, the end of the run) blocks
    until they are. A run killed meanwhile leaves ``.tmp-step_N``, never read, as a killed
    synchronous save does."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 0, async_save: bool = False, timeout=None,
                 device: torch.device | None = None):
        self.root, self.keep_last = Path(root), keep_last
        self.group = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self.device = device or torch.device("cpu")  # the default group's collectives (poll) run here
        self.pending: dict | None = None

    def save(self, step: int, model: nn.Module, optimizer, trainer_state: dict, config_yaml: str) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()
        name = step_dir_name(step)
        final, tmp = self.root / name, self.root / f".tmp-{name}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # e.g. the end-of-run save at a step that was just saved
                shutil.rmtree(final)
            tmp.mkdir()
        _barrier()
        state = _dcp_state(model, optimizer)
        try:
            if self.group is None:
                dcp.save(state, checkpoint_id=str(tmp))
                future = None
            else:  # staged (copied to host memory) before it returns: the next steps may change the weights
                future = dcp.async_save(state, storage_writer=_async_writer(tmp), process_group=self.group)
            torch.save(torch.get_rng_state(), tmp / f"rng_rank{_rank()}.pt")
        except (Exception, CheckpointException) as e:  # DCP's gathered failure is a BaseException
            raise _write_failed(tmp, e) from e
        self.pending = {"step": step, "tmp": tmp, "final": final, "future": future, "config": config_yaml,
                        "state": json.dumps(trainer_state, indent=1)}  # as it is now, not when published
        if future is None:
            self.wait()
        return final

    def poll(self) -> None:
        """Publish a pending asynchronous save whose writes have finished on every rank."""
        if self.pending is None:
            return
        done = torch.tensor([float(self.pending["future"].done())], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is written on every rank, then publish it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            if pending["future"] is not None:
                pending["future"].result()
            _barrier()
            checkpoint_io.hash_share(pending["tmp"])  # the ranks hash the written files between them
            _barrier()
            if _rank() == 0:
                self._publish(pending)
        except (Exception, CheckpointException) as e:  # DCP's gathered failure is a BaseException
            raise _write_failed(pending["tmp"], e) from e
        _barrier()

    def _publish(self, pending: dict) -> None:
        tmp, final, step = pending["tmp"], pending["final"], pending["step"]
        if os.environ.get(FAULT_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        (tmp / "config.yaml").write_text(pending["config"])
        (tmp / "trainer_state.json").write_text(pending["state"])
        checkpoint_io.write_checksums(tmp, ["config.yaml", "trainer_state.json"])
        os.rename(tmp, final)
        link = self.root / ".latest.tmp"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(final.name)
        os.replace(link, self.root / "latest")
        if self.keep_last > 0:
            complete = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)))
            for _, old in complete[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)


class CheckpointWriteFailed(UserError):
    """A save that could not be written (a full disk, a quota, a read-only or vanished mount)."""


def _write_failed(tmp: Path, error: BaseException) -> CheckpointWriteFailed:
    """One line for a failed save: the cause, the space left, and what is still safe. The partial
    ``.tmp-step_N`` is removed (it is never read, and it holds the space a rerun needs)."""
    root, name = tmp.parent, tmp.name.removeprefix(".tmp-")
    cause = checkpoint_io.gathered_failures(error)[0]
    text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    try:  # measured before the partial files go: what the write ran into
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB were free there"
    except OSError:
        free = "its file system unreadable"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = root / "latest"
    newest = os.readlink(latest) if latest.is_symlink() else "none yet"
    return CheckpointWriteFailed(f"could not write checkpoint {name} in {root}: {text} ({free}); the newest complete "
                                 f"checkpoint ({newest}) is untouched: free space, then rerun with --resume auto")


def _async_writer(path: Path):
    """DCP's file writer; under ``SLOW_WRITE_ENV`` (tests) one that waits before writing, so that a
    test can kill the run while the write is still in flight."""
    from torch.distributed.checkpoint import FileSystemWriter

    delay = float(os.environ.get(SLOW_WRITE_ENV, 0) or 0)
    if not delay:
        return FileSystemWriter(str(path))

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(delay)
            return super().write_data(plan, planner)

    return SlowWriter(str(path))


def save(ckpt_root: str | os.PathLike, step: int, model: nn.Module, optimizer, trainer_state: dict,
         config_yaml: str, keep_last: int = 0) -> Path:
    """One synchronous save (collective): :class:`Checkpointer` for a single checkpoint."""
    return Checkpointer(ckpt_root, keep_last).save(step, model, optimizer, trainer_state, config_yaml)


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, verified: bool = False, model_cfg=None) -> dict:
    """Collective: restores model (+ optimizer) and this rank's RNG; returns trainer_state.
    ``verified``: the checksums were just checked; ``model_cfg``: the recipe's (its families are
    checked against the checkpoint's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    path = Path(path)
    if not verified:
        checkpoint_io.verify(path)
    flat = _flat_optim(path)
    state = _dcp_state(model, optimizer, flat)
    check_fits(path, state["model"], model_cfg)
    recipe_only = _group_names_missing(path, state["optim"]) if optimizer is not None and flat else {}
    checkpoint_io.dcp_load(state, path)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        state["optim"].update(recipe_only)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=flat))
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.exists():  # absent when resuming with more ranks than saved: keep the seeded state
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())


def load_weights(path: str | os.PathLike, model: nn.Module, model_cfg=None) -> None:
    """Collective: only the model weights of a checkpoint into ``model`` (any parallel layout); LoRA
    adapters the checkpoint does not hold keep their values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from omniweave.models.lora import is_adapter_name

    checkpoint_io.verify(path)
    state = _dcp_state(model, None)
    saved = checkpoint_io.read_metadata(path).state_dict_metadata
    fresh = [n for n in state["model"] if is_adapter_name(n) and f"model.{n}" not in saved]
    check_fits(path, state["model"], model_cfg, fresh=set(fresh))
    for n in fresh:  # LoRA on a run trained without it: its adapters keep their fresh initialisation
        del state["model"][n]
    checkpoint_io.dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not fresh))


def load_model(path: str | os.PathLike, model_cfg=None) -> tuple[nn.Module, dict]:
    """(model on CPU, model_cfg) from a checkpoint dir, a checkpoints dir or a run dir, without a
    process group: ``omniweave hf export`` and evaluation. The model config comes from the
    checkpoint's ``config.yaml`` unless given."""
    import yaml

    from omniweave.models.registry import build_model

    ckpt = resolve_checkpoint(path)
    checkpoint_io.verify(ckpt, collective=False)
    if model_cfg is None:
        model_cfg = yaml.safe_load((ckpt / "config.yaml").read_text())["model"]
    from omniweave.config import to_dict

    model_cfg = to_dict(model_cfg)
    with torch.device("meta"):
        model = build_model(model_cfg)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    check_fits(ckpt, state["model"], model_cfg, collective=False)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        checkpoint_io.dcp_load(state, ckpt)
    model.load_state_dict(state["model"])
    if hasattr(model, "foundation") and hasattr(model.foundation, "tie_weights"):
        model.foundation.tie_weights()
    return model, model_cfg


def load_model_for_eval(run_dir: str | os.PathLike, cfg) -> nn.Module:
    """The model of a run's latest complete checkpoint, on CPU, in eval mode."""
    model, _ = load_model(run_dir, cfg.model)
    return model.eval()
