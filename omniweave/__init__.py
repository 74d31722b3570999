"""omniweave: train multimodal models (text, images, video, audio) on an LLM backbone."""

from omniweave.torchvision_compat import make_torchvision_importable as _make_torchvision_importable

__version__ = "0.1.0"

_make_torchvision_importable()  # before anything imports transformers (see torchvision_compat.py)
