"""``omniweave recipes``: the built-in recipes (package data), one a line with what each is."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from omniweave.config import recipes_listing

    print(recipes_listing())
    return 0
