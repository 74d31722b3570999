"""Let torchvision's Python transforms import beside a CPU build of torch.

transformers' Qwen2-VL / Qwen2.5-VL video processors (the reference our video pipeline is tested
against, and what ``hf verify`` compares video pixels with) run on torchvision's transforms, which
are plain torch ops. But PyPI's torchvision wheel for a given torch is a CUDA build: its compiled
detection ops (``_C.so``) link ``libtorch_cuda``, so beside the CPU build of torch they fail to
load, and ``import torchvision`` then dies registering fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` ("operator torchvision::nms does not exist"); transformers, which sees the
package installed, fails with it.

:func:`make_torchvision_importable` runs just before the first ``import torchvision`` of a
process that imported omniweave (:func:`install`, called by ``import omniweave``, puts a finder
first on ``sys.meta_path`` that calls it; torch is not imported before then). Where torchvision is
not installed, or its compiled ops load (a matching torch build), it does nothing. Otherwise it
defines just those two operator schemas, without kernels, so the import succeeds: resize,
normalise and the other transforms work; calling ``torchvision.ops.nms`` raises (no kernel), as it
should. A script that imports transformers before omniweave on such a machine still fails inside
torchvision: import omniweave first (tests/conftest.py and the bench scripts do).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# The schemas torchvision's _meta_registrations.py registers fake kernels for unconditionally.
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # fmt: skip
_LIBRARY = None  # the torch.library.Library holding the schemas: they live as long as it does


def make_torchvision_importable() -> str:
    """Returns what it found: "absent", "imported" (already imported: nothing to do), "native"
    (its compiled ops load) or "schemas" (they do not: the schemas were defined)."""
    global _LIBRARY
    if "torchvision" in sys.modules or _LIBRARY is not None:
        return "imported" if _LIBRARY is None else "schemas"
    try:
        spec = importlib.util.find_spec("torchvision")
    except ValueError:
        spec = None
    if spec is None or spec.origin is None:
        return "absent"
    import torch

    compiled = Path(spec.origin).parent / "_C.so"
    try:
        torch.ops.load_library(str(compiled))  # what torchvision itself does first; idempotent
        return "native"
    except (OSError, ImportError, RuntimeError):
        pass
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)
    return "schemas"


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Finds nothing; on the first lookup of ``torchvision`` it steps aside and prepares the import."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            uninstall()
            make_torchvision_importable()
        return None


_FINDER = _BeforeTorchvision()


def install() -> None:
    """Prepare torchvision's import lazily (see the module doc); idempotent."""
    if "torchvision" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
