"""``--quick``, the smoke run every benchmark in bench/ has (tests/test_docs.py runs each documented
bench command with ``--quick --out DIR``).

A quick run takes the same code path end to end (data, every arm of the comparison, the table,
the PNG, the JSON) at tiny sizes with one repeat, whatever sizes the command line gives. Its
numbers are not meaningful figures: the sizes are too small and one repeat on a shared box is noise.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

HELP = ("smoke run: the same code path end to end at tiny sizes with 1 repeat, overriding the size flags "
        "(the docs tests run it); its numbers are NOT meaningful figures")


def note(sizes: str) -> None:
    """The one-line notice a quick run prints first."""
    print(f"--quick: a smoke run ({sizes}); its numbers are not meaningful figures", flush=True)


def work_dir(work: str | None, quick: bool, default: str) -> str:
    """``--work`` if given; else ``default``, or with ``--quick`` a fresh temporary folder (removed
    at exit), so that concurrent smoke runs (test suites) never share one."""
    if work:
        return work
    if not quick:
        return default
    tmp = tempfile.mkdtemp(prefix=Path(default).name + "-quick-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return tmp
