"""omniweave: train multimodal models (text, images, video, audio) on an LLM backbone."""

from omniweave import torchvision_compat as _torchvision_compat

__version__ = "0.1.0"

_torchvision_compat.install()  # before anything imports torchvision (see torchvision_compat.py)
