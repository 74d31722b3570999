"""Recipes: one YAML per run, composed with Hydra, overridable with ``key=value``.

A recipe names its components with a Hydra defaults list; the component groups live in
``configs/models/<kind>/`` and are on the search path, e.g.::

    defaults:
      - image_encoder@model.image_encoder: qwen2_5_vit_tiny
      - projector@model.projector: patch_merger
      - foundation@model.foundation: qwen2_5_tiny
      - _self_
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

CONFIGS_DIR = Path(os.environ.get("OMNIWEAVE_CONFIGS", Path(__file__).resolve().parents[1] / "configs"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """A recipe file path, or the name of a built-in recipe in ``configs/recipes/``."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p.resolve()
    builtin = CONFIGS_DIR / "recipes" / f"{p.stem}.yaml"
    if builtin.exists():
        return builtin
    raise FileNotFoundError(f"recipe {str(name_or_path)!r} not found (nor as {builtin})")


def load_recipe(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose a recipe with Hydra and apply ``key=value`` overrides; returns a resolved config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    path = recipe_path(name_or_path)
    search = [f"file://{CONFIGS_DIR / 'models'}", f"file://{CONFIGS_DIR}"]
    GlobalHydra.instance().clear()
    # megatron-energon installs a Hydra search-path plugin (multistorageclient) that logs a
    # traceback whenever it has no profile configured; it has nothing to do with recipes.
    logging.getLogger("multistorageclient").setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), initialize_config_dir(config_dir=str(path.parent), version_base=None):
            warnings.filterwarnings("ignore", message=r"provider=msc")
            cfg = compose(
                config_name=path.stem,
                overrides=[*overrides, f"hydra.searchpath=[{','.join(search)}]"],
            )
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.resolve(cfg)
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    return cfg


def to_dict(cfg: DictConfig | dict[str, Any] | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)
