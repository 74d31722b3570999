"""transformers beside a torchvision that does not load.

transformers decides once per process whether torchvision is installed (by ``find_spec``) and
then imports it for its vision models and processors, the PIL image processors included. A
torchvision whose compiled ops do not load beside this torch — pip's CUDA build of torchvision
next to a CPU build of torch: ``operator torchvision::nms does not exist`` — therefore makes every
vision-language class of transformers fail to import. Before omniweave first uses transformers
(``hf verify``, a PEFT adapter's export or load, the transformers arm of bench/train.py) it calls
:func:`torchvision_loads`: torchvision is imported once; a working one (every GPU user's) is left
exactly as it is; a broken one gets one warning and is made invisible
(``sys.modules["torchvision"] = None``, which ``find_spec`` reports as absent), so transformers
takes its no-torchvision paths: PIL image processors, and no video processor (``hf verify`` then
feeds our video pixels to both sides). Importing omniweave does none of this: nothing is patched.
"""

from __future__ import annotations

import logging
import sys

_REASON: list[str] = []  # why torchvision does not load here (set once)


def torchvision_loads() -> bool:
    """Whether torchvision imports in this process (see the module doc); False when it is not
    installed or is broken (then hidden from transformers, with one warning)."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"] is not None
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001 - whatever a broken build raises, the answer is "no"
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # find_spec -> None: transformers sees no torchvision
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        _REASON.append(first)
        logging.getLogger("omniweave.hf").warning(
            f"warning: torchvision is installed but does not load beside this torch ({first}); transformers' "
            "torchvision-based processors are off (install the torchvision built for this torch to use them)")
        return False


def why_not() -> str:
    """A short reason for a report line: not installed, or the import error."""
    return f"torchvision does not load here: {_REASON[0]}" if _REASON else "torchvision is not installed"
