"""``omniweave hf verify DIR`` for diffusers Wan 2.1 folders: the DiT and the VAE, each loaded twice
-- by diffusers (the reference) and by omniweave -- and run on the same random inputs, fp32 on the CPU.

    transformer/  (config.json ``_class_name: WanTransformer3DModel``)
        velocity  two random latent clips of different, non-square sizes (2·pt x 3·ph x 5·pw and
                  pt x 4·ph x 2·pw latent cells), each with its own timestep and random text states
                  (some zero rows at the end, as the pipeline's padding), packed in one row through
                  omniweave's WanDiT (hf/wan.py ``load_wan_dit``) vs each alone through diffusers'
                  ``WanTransformer3DModel.from_pretrained``. An image-to-video DiT (``image_dim``
                  set) also gets random image features per clip (257 and 13 tokens; FLF2V:
                  ``pos_embed_seq_len`` each) and, as diffusers splits the image tokens off by a
                  hard-coded text length, text padded with zero rows to 512
    vae/          (``_class_name: AutoencoderKLWan``)
        latents   a random video [1, 3, 5, 4·s, 6·s] (s = 8, the spatial factor) encoded:
                  ``WanVAE.encode`` vs ``encode(x).latent_dist.mode()``
        decoded   those latents decoded: ``WanVAE.decode`` vs ``decode(z).sample``

DIR is a model folder (weights ``diffusion_pytorch_model.safetensors`` or sharded
``diffusion_pytorch_model-0000i-of-0000n.safetensors`` + ``.index.json``) or a pipeline root
(``model_index.json``): then its ``transformer/``, ``transformer_2/`` and ``vae/`` are each checked.
Exit 1 when a difference exceeds ``--atol`` (default 1e-4: measured ~1e-6 on tiny random models, see
tests/test_wan_hf.py), 0 otherwise; 2 for a folder this cannot check (a Wan 2.2 VAE, another
diffusers class) or when diffusers is not installed (it is the reference only: not an
omniweave dependency). The reference runs first and is freed before ours loads, so the peak memory
is one fp32 copy of the model (1.3B DiT: ~5.7 GB; 14B: ~57 GB). The text encoder is transformers'
own umT5 in omniweave (diffusion/text_encoder.py): nothing of ours to compare there.
"""

from __future__ import annotations

import gc
import json
import sys
from functools import partial
from pathlib import Path

import torch

from omniweave.errors import UserError

TRANSFORMER = "WanTransformer3DModel"
VAE = "AutoencoderKLWan"
PIPELINE_PARTS = ("transformer", "transformer_2", "vae")
TEXT_ROWS = ((11, 6), (7, 12))  # per clip: random text-state rows, then zero rows (the pipeline's padding)
IMAGE_ROWS = (257, 13)  # I2V: image-feature tokens per clip (Wan's CLIP gives 257)
I2V_TEXT_LEN = 512  # diffusers' WanAttnProcessor takes all but the last 512 context rows as the image's


def diffusers_class(hf_dir: str | Path) -> str | None:
    """``_class_name`` of a diffusers model folder, ``"pipeline"`` for a pipeline root
    (``model_index.json`` without ``config.json``), None for anything else (a transformers folder)."""
    hf_dir = Path(hf_dir)
    cfg = hf_dir / "config.json"
    if not cfg.is_file():
        return "pipeline" if (hf_dir / "model_index.json").is_file() else None
    try:
        return json.loads(cfg.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        return None


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise UserError("verifying a diffusers folder needs diffusers as the reference: pip install diffusers") from None
    return diffusers


def verify_diffusers(args, hf_dir: Path, report) -> int:
    """The rows of every Wan part under ``hf_dir``, reported against ``args.atol``."""
    extras = [flag for flag, on in (("--image", args.image), ("--video", args.video), ("--audio", args.audio),
                                    ("--adapter", args.adapter), ("--use-audio-in-video", args.use_audio_in_video))
              if on]  # fmt: skip
    if extras:
        print(f"error: {', '.join(extras)}: not for a diffusers Wan folder ({hf_dir})", file=sys.stderr)
        return 2
    kind = diffusers_class(hf_dir)
    if kind == "pipeline":
        parts = [(hf_dir / p, diffusers_class(hf_dir / p), f"{p}/") for p in PIPELINE_PARTS
                 if (hf_dir / p / "config.json").is_file()]  # fmt: skip
        if not parts:
            raise UserError(f"{hf_dir}: a diffusers pipeline without transformer/ or vae/ folders")
    else:
        parts = [(hf_dir, kind, "")]
    for path, cls, _ in parts:
        if cls not in (TRANSFORMER, VAE):
            raise UserError(f"{path}: diffusers {cls}: hf verify checks {TRANSFORMER} and {VAE} folders (Wan 2.1)")
    _diffusers()
    rows = []
    for path, cls, prefix in parts:
        part = verify_transformer(path, args.seed) if cls == TRANSFORMER else verify_vae(path, args.seed)
        rows += [(prefix + what, d, note) for what, d, note in part]
        gc.collect()
    return report(rows, args.atol)


def _load(load, who: str, path: Path):
    """``load()`` in eval mode; what makes a loader refuse the folder (a missing or unknown tensor, a
    shape) is one line naming the side, not a traceback."""
    try:
        model = load()
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path}: {who} cannot load it: {type(e).__name__}: {first}") from None
    return model.eval() if isinstance(model, torch.nn.Module) else model


def _clip_sizes(patch) -> list[tuple[int, int, int]]:
    pt, ph, pw = patch
    return [(2 * pt, 3 * ph, 5 * pw), (pt, 4 * ph, 2 * pw)]  # latent (F, H, W): non-square, different sizes


def verify_transformer(path: Path, seed: int = 0) -> list[tuple[str, float, str]]:
    from diffusers import WanTransformer3DModel

    from omniweave.models.components.wan_dit import patchify_clips, unpatchify_clips
    from omniweave.models.hf.wan import config_from_diffusers, load_wan_dit, read_diffusers_config

    config = read_diffusers_config(path, TRANSFORMER)
    try:
        cfg = config_from_diffusers(config)
    except ValueError as e:  # fields of a later variant, an inconsistent I2V config
        raise UserError(f"{path}: {e}") from None
    g = torch.Generator().manual_seed(seed)
    sizes = _clip_sizes(cfg.patch_size)
    latents = [torch.randn(cfg.in_channels, *s, generator=g) for s in sizes]
    i2v = cfg.image_dim is not None
    text_rows = [(n, I2V_TEXT_LEN - n) for n, _ in TEXT_ROWS] if i2v else TEXT_ROWS
    texts = [torch.cat([torch.randn(n, cfg.text_dim, generator=g), torch.zeros(z, cfg.text_dim)]) for n, z in text_rows]
    timesteps = (torch.rand(len(sizes), generator=g) * 1000).round(decimals=2)
    images = [torch.randn(cfg.pos_embed_seq_len or n, cfg.image_dim, generator=g) for n in IMAGE_ROWS] if i2v else None
    image_kw = {}
    if i2v:
        image_kw = dict(image=torch.cat(images), image_cu_seqlens=torch.tensor(
            [0, *torch.tensor([c.shape[0] for c in images]).cumsum(0).tolist()], dtype=torch.int32))

    # ours first: its strict loader refuses a folder with missing or unknown tensors in one line, where
    # diffusers would warn and run with uninitialised weights; each model is freed before the next loads
    ours = _load(lambda: load_wan_dit(path, torch.float32, "cpu"), "omniweave", path)
    tokens, grid = patchify_clips(latents, cfg.patch_size)
    cu = torch.tensor([0, *torch.tensor([c.shape[0] for c in texts]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        got = unpatchify_clips(ours(tokens, grid, timesteps, torch.cat(texts), cu, **image_kw), grid,
                               cfg.out_channels, cfg.patch_size)
    del ours
    gc.collect()

    ref = _load(lambda: WanTransformer3DModel.from_pretrained(str(path), torch_dtype=torch.float32), "diffusers", path)
    def image_of(i):  # diffusers' FLF2V embedder takes the clip's two images as a batch of 2 and joins them
        if not i2v:
            return None
        return images[i].view(2, -1, cfg.image_dim) if cfg.pos_embed_seq_len else images[i][None]

    with torch.no_grad():
        want = [ref(hidden_states=x[None], timestep=t[None], encoder_hidden_states=c[None],
                    encoder_hidden_states_image=image_of(i), return_dict=False)[0][0]
                for i, (x, t, c) in enumerate(zip(latents, timesteps, texts))]  # fmt: skip
    del ref
    err = max((a - b).abs().max().item() for a, b in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    shapes = ", ".join(f"{cfg.in_channels}x{f}x{h}x{w}" for f, h, w in sizes)
    when = [round(t, 2) for t in timesteps.tolist()]
    img = f", image tokens {[c.shape[0] for c in images]}" if i2v else ""
    return [("velocity", err,
             f"clips [C,F,H,W] {shapes}, t {when}, text rows {[c.shape[0] for c in texts]}{img}: packed in one row "
             f"(omniweave WanDiT) vs each alone (diffusers {TRANSFORMER}); fp32, |v| max {scale:.3g}")]


def verify_vae(path: Path, seed: int = 0) -> list[tuple[str, float, str]]:
    from diffusers import AutoencoderKLWan

    from omniweave.models.components.wan_vae import WanVAE, config_from_diffusers
    from omniweave.models.hf.wan import read_diffusers_config, read_diffusers_weights

    config = read_diffusers_config(path, VAE)
    try:
        cfg = config_from_diffusers(config)
        ours = WanVAE(cfg)
    except ValueError as e:  # Wan 2.2's VAE, encoder attention, unknown fields
        raise UserError(f"{path}: {e}") from None
    s = cfg.spatial_factor
    g = torch.Generator().manual_seed(seed)
    video = torch.rand(1, cfg.in_channels, 5, 4 * s, 6 * s, generator=g) * 2 - 1

    _load(partial(ours.load_state_dict, read_diffusers_weights(path), strict=True), "omniweave", path)
    ours.eval()
    with torch.no_grad():
        got = ours.encode(video)
        got_dec = ours.decode(got)
    del ours
    gc.collect()

    ref = _load(lambda: AutoencoderKLWan.from_pretrained(str(path), torch_dtype=torch.float32), "diffusers", path)
    with torch.no_grad():
        want = ref.encode(video).latent_dist.mode()
        want_dec = ref.decode(got).sample  # the same latents in
    del ref
    shape = "x".join(map(str, video.shape[1:]))
    return [("latents", (got - want).abs().max().item(),
             f"video [C,T,H,W] {shape} in [-1, 1] -> {list(want.shape[1:])}: WanVAE.encode vs "
             f"{VAE}.encode().latent_dist.mode(); fp32, |mu| max {want.abs().max().item():.3g}"),
            ("decoded", (got_dec - want_dec).abs().max().item(),
             f"those latents -> {list(want_dec.shape[1:])}: WanVAE.decode vs {VAE}.decode().sample; fp32")]
