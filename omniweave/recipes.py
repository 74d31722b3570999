"""``omniweave recipes`` (also ``omniweave train --list``): the built-in recipes (package data in
omniweave/configs/recipes/), one a line with what each is."""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print(listing())
    return 0


def listing() -> str:
    """Each built-in recipe's name and description, then where they live and how to use one."""
    from omniweave.config import CONFIGS_DIR

    recipes = builtin_recipes()
    width = max(map(len, recipes), default=0)
    return "\n".join(f"{name:<{width}}  {what}" for name, what in recipes.items()) + (
        f"\n\n{len(recipes)} built-in recipes in {CONFIGS_DIR / 'recipes'}; use one by name "
        "(omniweave train NAME, data pack --recipe NAME) or copy it and pass the YAML path")


def builtin_recipes() -> dict[str, str]:
    """Every built-in recipe's name -> a one-line description (``description``)."""
    from omniweave.config import builtin_recipe_paths

    return {path.stem: description(path) for path in builtin_recipe_paths()}


def description(path: Path, width: int = 110) -> str:
    """The first sentence of the recipe's leading comment without its (asides); a recipe with no
    leading comment is described by what its defaults list wires, e.g. ``foundation qwen2_5_tiny``."""
    lines = path.read_text().splitlines()
    comment = " ".join(ln.lstrip("# ").strip() for ln in lines[: next((i for i, ln in enumerate(lines)
                                                                        if not ln.startswith("#")), len(lines))])
    removed = 1
    while removed:  # innermost asides first, so nested ones go too
        comment, removed = re.subn(r"\s*\([^()]*\)", "", comment)
    text = re.split(r"\.\s", comment, maxsplit=1)[0].rstrip(".").strip()
    text = text or ", ".join(wired(path)) or "no comment and no defaults list"
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def wired(path: Path) -> list[str]:
    """What a recipe's defaults list wires: ``foundation qwen2_5_tiny``, ``on demo`` for a parent recipe."""
    from omegaconf import OmegaConf

    out = []
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or []:
        if isinstance(entry, dict):  # group@package: option, or override group@package: option
            out += [f"{key.removeprefix('override ').split('@')[0]} {option}" for key, option in entry.items()]
        elif entry != "_self_":
            out.append(f"on {entry}")
    return out
