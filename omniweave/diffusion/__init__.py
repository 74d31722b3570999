"""Video diffusion (Wan-style DiT trained by rectified flow on offline latents): docs/diffusion.md."""
