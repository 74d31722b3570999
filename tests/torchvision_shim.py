"""Tests only: let torchvision's Python transforms import beside the CPU build of torch of our dev venv.

transformers' Qwen2-VL / Qwen2.5-VL video processors (the reference our video pipeline is tested
against) run on torchvision's transforms, which are plain torch ops. But PyPI's torchvision for a
given torch is a CUDA build: its compiled ops link ``libtorch_cuda``, so beside the CPU build of
torch they fail to load, and ``import torchvision`` dies registering fake kernels for
``torchvision::nms`` ("operator torchvision::nms does not exist").

:func:`install` (tests/conftest.py, before any test module imports transformers) puts a finder
first on ``sys.meta_path``; on the first ``import torchvision`` it runs
:func:`make_torchvision_importable`: where torchvision is not installed, or its compiled ops load
(a matching torch build), nothing is done. Otherwise it defines just those two operator schemas,
without kernels, so the import succeeds: resize, normalise and the other transforms work; calling
``torchvision.ops.nms`` raises (no kernel), as it should.

The probe loads the compiled ops the way torchvision does: ``_C.so`` up to 0.28, ``_C_stable.so``
(built against torch's stable ABI) from 0.29. Probing ``_C.so`` alone — what omniweave's import
once did, from the package — fails in a healthy torch 2.14 + torchvision 0.29 environment, and the
schemas it then defined made torchvision's own registration abort the process. The library itself
never does this: it only hides a torchvision that does not load from transformers, at the point of
use (omniweave/models/hf/torchvision_guard.py).
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

    for compiled in sorted(Path(spec.origin).parent.glob("_C*.so")):  # _C.so (<= 0.28), _C_stable.so (0.29+)
        try:
            torch.ops.load_library(str(compiled))  # what torchvision itself does first; idempotent
            return "native"
        except (OSError, ImportError, RuntimeError):
            pass
    if _schemas_defined(torch):
        return "schemas"  # another copy of this shim defined them (the vLLM venv's, .ci/vllm_env.sh)
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _LIBRARY.define(schema)
    return "schemas"


def _schemas_defined(torch) -> bool:
    try:
        torch.ops.torchvision.nms.default  # resolves only once a schema exists
        return True
    except (AttributeError, RuntimeError):
        return False


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
