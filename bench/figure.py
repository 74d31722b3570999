"""The PNG every benchmark in bench/ writes: matplotlib without a display, and one way to finish a
figure (grid, tight layout, save, close) so that the plots look alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (benchmarks run on headless machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, grid=(), dpi: int = 120) -> None:
    """Light grid lines on the axes in ``grid``, tight layout, write ``path``, close ``fig``."""
    for ax in grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_results(out: Path, name: str, table: str, data, plot, setting: str) -> None:
    """What a benchmark leaves in ``out``: ``name``.png (``plot(path)`` draws it), ``name``.json
    (``data``) and ``name``.md: the command as run, ``setting`` in brackets, the table."""
    out.mkdir(parents=True, exist_ok=True)
    plot(out / f"{name}.png")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    cmd = f"python bench/{name}.py " + " ".join(sys.argv[1:])
    (out / f"{name}.md").write_text(f"`{cmd.strip()}` ({setting})\n\n{table}\n")
