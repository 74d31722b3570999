"""omniweave: train multimodal models (text, images, video, audio) on an LLM backbone."""

__version__ = "0.1.0"
