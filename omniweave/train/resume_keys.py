"""Which recipe keys may differ from the checkpoint's when a run resumes.

A resumed run is the checkpoint's run continued, so a key that decides what was learned so far —
the model, the data and how it is cut into samples, the batch, the seed, the objective — must be
the checkpoint's: a change there is refused in one line naming the keys (start a new run from the
weights with ``train.init_from`` instead). The keys below only say how to go on; a change there
is applied from the resumed step and recorded (the run's ``config.yaml`` and its next
checkpoints hold the new values). The learning-rate keys take effect as if the run had had them
from the start: the rate at step s is ``lr × factor(s)`` of the new schedule
(``Engine.apply_schedule``). ``data.mix`` (a list) may change only in its entries' ``path``
(the same datasets moved, as ``data.path`` may); its entries, weights, epochs and names are kept.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from omniweave.errors import UserError

# fnmatch patterns of the dotted keys a resume may change (docs/training.md lists them)
MAY_CHANGE = (
    "output_dir",
    # the schedule and the optimizer's hyperparameters (applied to the restored optimizer)
    "train.steps", "train.lr", "train.min_lr_ratio", "train.warmup", "train.schedule",
    "train.weight_decay", "train.betas", "train.eps", "train.grad_clip",
    "model.*.lr", "model.*.lr_scale", "model.*.weight_decay",  # per-component groups (train/optim.py)
    # how the steps run, not what they compute
    "train.precision", "train.cpu_threads", "train.ac", "train.offload", "train.init_from",
    "train.save_interval", "train.keep_last", "train.async_save", "train.collective_timeout",
    "train.log_interval", "train.max_bad_steps", "train.eval_interval", "train.save_hf", "rl.rollout.overlap",
    # the layout (checkpoints are layout-free) and where the same data lives
    "parallel.*", "model.*.tp", "data.path", "data.num_workers", "data.balance", "data.balance_refit",
    "eval.*", "demo.*",
)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


# optional keys no schema fills in: one the checkpoint's recipe lacks was unset there
UNSET_WHEN_ABSENT = ("model.*.lr", "model.*.lr_scale", "model.*.weight_decay")


def changed_keys(saved: dict, now: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs: {key: (checkpoint's, recipe's)}. A key the checkpoint's
    recipe does not have (one added to omniweave since) is not a change, unless it is one of
    :data:`UNSET_WHEN_ABSENT` set now."""
    old, new = flatten(saved), flatten(now)
    added = {k: (None, new[k]) for k in sorted(new) if k not in old and new[k] is not None
             and any(fnmatchcase(k, pattern) for pattern in UNSET_WHEN_ABSENT)}
    return {k: (old[k], new.get(k)) for k in sorted(old) if k in new and old[k] != new[k]} | \
        {k: (old[k], None) for k in sorted(old) if k not in new and old[k] is not None} | added


def may_change(key: str, old: Any = None, new: Any = None) -> bool:
    """Whether ``key`` may go from ``old`` to ``new`` on resume."""
    if key == "data.mix":
        return _mix_moved(old, new)
    return any(fnmatchcase(key, pattern) for pattern in MAY_CHANGE)


def _mix_moved(old: Any, new: Any) -> bool:
    """The same mix (entries, weights or epochs, names), only its datasets' paths changed."""
    if not isinstance(old, list) or not isinstance(new, list) or len(old) != len(new):
        return False
    rest = [[{k: v for k, v in e.items() if k != "path"} if isinstance(e, dict) else e for e in m] for m in (old, new)]
    return rest[0] == rest[1]


def _show(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in changes.items())


def check_resume_keys(ckpt: Path, cfg) -> dict[str, tuple[Any, Any]]:
    """The keys of ``cfg`` that differ from checkpoint ``ckpt``'s recipe and may (returned: they
    are applied); a UserError naming those that may not."""
    import yaml
    from omegaconf import OmegaConf

    saved = yaml.safe_load((Path(ckpt) / "config.yaml").read_text()) or {}
    changes = changed_keys(saved, OmegaConf.to_container(cfg, resolve=False))  # config.yaml is unresolved too
    refused = {k: v for k, v in changes.items() if not may_change(k, *v)}
    if refused:
        raise UserError(
            f"--resume {ckpt}: the recipe changes {_show(refused)}, which a resumed run must keep (they decide "
            "what it has learned so far); put them back, or start a new run from these weights with "
            f"train.init_from={ckpt} (docs/training.md lists the keys a resume may change)")
    return changes


def describe_applied(changes: dict[str, tuple[Any, Any]]) -> str | None:
    """The line a resumed run prints about the keys it applies (None: nothing changed that matters)."""
    shown = {k: v for k, v in changes.items() if k != "output_dir"}
    return f"resume: applying the recipe's {_show(shown)} from this step on" if shown else None
