"""argparse value types that refuse out-of-range numbers in one line (``--packs-per-shard 0``
would otherwise crash far from the flag, or loop)."""

from __future__ import annotations

import argparse


def integer(minimum: int):
    """An ``int`` flag value of at least ``minimum``: ``type=integer(1)``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}, the least it can be")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive():
    """A ``float`` flag value above 0: ``type=positive()``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{value} must be above 0")
        return value

    parse.__name__ = "number > 0"
    return parse
