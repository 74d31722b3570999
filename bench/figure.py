"""The PNG every benchmark in bench/ writes: matplotlib without a display, and one way to finish a
figure (grid, tight layout, save, close) so that the plots look alike."""

from __future__ import annotations

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
