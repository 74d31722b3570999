"""User errors: mistakes in what a user asked for (a recipe name, a key, a path), as opposed to bugs.

The CLI prints a ``UserError`` as one line and exits 2 (``--debug`` shows the traceback). Raise it
(or a subclass) where the message alone tells the user what to change.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix from the message alone."""


def first_few(items, k: int, sep: str = ", ") -> str:
    """``items[:k]`` joined, and how many more there are: the list an error line shows."""
    items = list(items)
    return sep.join(map(str, items[:k])) + (f" (and {len(items) - k} more)" if len(items) > k else "")
