"""diffusers Wan folders: ``omniweave hf verify DIR`` (hf/verify_wan.py) on tiny random
``WanTransformer3DModel`` / ``AutoencoderKLWan`` folders written by diffusers' own ``save_pretrained``,
and the loader / exporter of hf/wan.py (``load_wan_dit``, ``save_wan_dit``).

Measured (fp32, CPU): velocity max|Δ| ~2e-6 (|v| up to ~4), VAE latents ~1e-7, decoded frames ~1.5e-6,
against ``--atol`` 1e-4. verify compares implementations, not a checkpoint with a truth: a value
changed in the file is read by both sides alike and still passes (tested); what must fail is omniweave
reading a tensor differently from diffusers, which the tests do by perturbing one tensor on our read
path only (exit 1, the printed error = the perturbation), and folders one loader refuses (exit 2).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from omniweave.cli import main
from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig, patchify_clips, unpatchify_clips
from omniweave.models.hf import wan
from tests.test_wan_dit import _randomise

diffusers = pytest.importorskip("diffusers")

PATCH = (1, 2, 2)
TINY = dict(num_attention_heads=3, attention_head_dim=20, in_channels=5, out_channels=3, text_dim=20, freq_dim=32,
            ffn_dim=44, num_layers=2, patch_size=PATCH)
ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """diffusers' own folders: transformer/ (one file), sharded/ (many shards + index), vae/, and a
    pipeline-like root/ (model_index.json + transformer/ + vae/)."""
    root = tmp_path_factory.mktemp("wan_hf")
    dit = diffusers.WanTransformer3DModel(**TINY).eval()
    _randomise(dit, 0)
    dit.save_pretrained(root / "transformer")
    dit.save_pretrained(root / "sharded", max_shard_size="20KB")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                     temperal_downsample=[False, True, True]).eval()
    with torch.no_grad():  # default gains are 1: perturb them and the biases
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.mul_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    vae.save_pretrained(root / "vae")
    pipe = root / "pipeline"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                       "transformer": ["diffusers", "WanTransformer3DModel"],
                                                       "vae": ["diffusers", "AutoencoderKLWan"]}))  # fmt: skip
    shutil.copytree(root / "transformer", pipe / "transformer")
    shutil.copytree(root / "vae", pipe / "vae")
    return {"model": dit, "root": root}


def _verify(path, capsys, *extra) -> tuple[int, dict[str, float], str]:
    """(exit code, {row: max|Δ|}, output) of ``omniweave hf verify path``."""
    code = main(["hf", "verify", str(path), *extra])
    captured = capsys.readouterr()
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^(\S+)\s+max\|Δ\| = (\S+)", captured.out, re.M)}
    print(captured.out, captured.err)
    return code, rows, captured.out + captured.err


def test_verify_transformer_folder(folders, capsys):
    sharded = folders["root"] / "sharded"
    assert len(list(sharded.glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 1
    for name in ("transformer", "sharded"):
        code, rows, out = _verify(folders["root"] / name, capsys)
        assert code == 0 and set(rows) == {"velocity"}, out
        assert rows["velocity"] < ATOL
        assert "5x2x6x10, 5x1x8x4" in out  # two non-square clips packed in one row


def test_verify_vae_folder(folders, capsys):
    code, rows, out = _verify(folders["root"] / "vae", capsys)
    assert code == 0 and set(rows) == {"latents", "decoded"}, out
    assert max(rows.values()) < ATOL
    assert "3x5x32x48" in out


def test_verify_pipeline_root_checks_every_part(folders, capsys):
    code, rows, out = _verify(folders["root"] / "pipeline", capsys)
    assert code == 0, out
    assert set(rows) == {"transformer/velocity", "vae/latents", "vae/decoded"}


def test_verify_fails_when_omniweave_reads_a_tensor_differently(folders, capsys, monkeypatch, tmp_path):
    path = tmp_path / "dit"
    shutil.copytree(folders["root"] / "transformer", path)
    # a changed value in the file: both sides read it, verify still passes (it compares implementations)
    f = path / wan.WEIGHTS_NAME
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    sd["blocks.1.ffn.net.2.weight"][0, 0] += 0.5
    save_file(sd, str(f), metadata={"format": "pt"})
    assert _verify(path, capsys)[0] == 0

    # omniweave alone reads proj_out.bias[0] off by 1e-3: that output cell moves by 1e-3 -> exit 1
    read = wan.read_diffusers_weights

    def perturbed(p, device="cpu"):
        tensors = read(p, device)
        tensors["proj_out.bias"] = tensors["proj_out.bias"].clone()
        tensors["proj_out.bias"][0] += 1e-3
        return tensors

    monkeypatch.setattr(wan, "read_diffusers_weights", perturbed)
    code, rows, out = _verify(path, capsys)
    assert code == 1 and "FAIL: velocity" in out
    assert rows["velocity"] == pytest.approx(1e-3, rel=1e-2)

    def perturbed_vae(p, device="cpu"):  # the VAE's quant_conv mean row 0: latent channel 0 moves
        tensors = read(p, device)
        tensors["quant_conv.bias"] = tensors["quant_conv.bias"].clone()
        tensors["quant_conv.bias"][0] += 1e-2
        return tensors

    monkeypatch.setattr(wan, "read_diffusers_weights", perturbed_vae)
    code, rows, out = _verify(folders["root"] / "vae", capsys)
    assert code == 1 and rows["latents"] == pytest.approx(1e-2, rel=1e-2)


def test_folders_a_loader_refuses_are_one_line_errors(folders, capsys, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    src = folders["root"] / "transformer"
    sd = load_file(str(src / wan.WEIGHTS_NAME))
    cases = {
        "unknown": ({**sd, "blocks.0.mystery.weight": torch.zeros(3)}, None, "no counterpart: blocks.0.mystery"),
        "missing": ({k: v for k, v in sd.items() if k != "blocks.1.ffn.net.2.bias"}, None, "missing tensors"),
        "i2v": (sd, {"image_dim": 1280, "added_kv_proj_dim": 60}, "missing tensors"),  # I2V config, T2V weights
        "i2v_bad": (sd, {"image_dim": 1280}, "image_dim (1280) and added_kv_proj_dim (None) are set together"),
        "other": (sd, {"_class_name": "UNet2DConditionModel"}, "checks WanTransformer3DModel and AutoencoderKLWan"),
    }
    for name, (tensors, config_patch, message) in cases.items():
        path = tmp_path / name
        shutil.copytree(src, path)
        save_file(tensors, str(path / wan.WEIGHTS_NAME), metadata={"format": "pt"})
        if config_patch:
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, **config_patch}))
        code, _, out = _verify(path, capsys)
        assert code == 2 and message in out, (name, out)
        assert "Traceback" not in out
    code, _, out = _verify(src, capsys, "--image", "x.png")
    assert code == 2 and "--image: not for a diffusers Wan folder" in out
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)  # diffusers not installed
    code, _, out = _verify(src, capsys)
    assert code == 2 and "pip install diffusers" in out


def test_load_wan_dit_matches_diffusers_and_refuses_a_half_i2v_config(folders, tmp_path):
    ref = folders["model"]
    for name in ("transformer", "sharded"):
        ours = wan.load_wan_dit(folders["root"] / name)
        assert not ours.training and ours.patch_embedding.weight.dtype == torch.float32
        want = wan.diffusers_to_ours(ref.state_dict())
        got = ours.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    half = wan.load_wan_dit(folders["root"] / "transformer", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    path = tmp_path / "i2v"
    shutil.copytree(folders["root"] / "transformer", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(ValueError, match="I2V: image_dim"):
        wan.load_wan_dit(path)
    (path / "config.json").write_text(json.dumps({**config, "_class_name": "AutoencoderKLWan"}))
    with pytest.raises(ValueError, match="not a WanTransformer3DModel"):
        wan.load_wan_dit(path)


def test_save_wan_dit_round_trip(tmp_path, capsys):
    cfg = WanDiTConfig(**TINY, attn_backend="math")
    ours = WanDiT(cfg).eval()
    _randomise(ours, 5)
    g = torch.Generator().manual_seed(6)
    latents = [torch.randn(5, 2, 6, 10, generator=g), torch.randn(5, 1, 4, 8, generator=g)]
    texts = [torch.randn(9, 20, generator=g), torch.randn(4, 20, generator=g)]
    timesteps = torch.tensor([731.25, 88.5])
    tokens, grid = patchify_clips(latents, PATCH)
    with torch.no_grad():
        mine = unpatchify_clips(ours(tokens, grid, timesteps, torch.cat(texts), torch.tensor([0, 9, 13])), grid, 3, PATCH)

    for name, shard in (("single", 10 * 10**9), ("sharded", 30_000)):
        path = wan.save_wan_dit(ours, tmp_path / name, max_shard_size=shard)
        config = json.loads((path / "config.json").read_text())
        assert config["_class_name"] == "WanTransformer3DModel" and config["_diffusers_version"]
        assert config["image_dim"] is None and config["patch_size"] == [1, 2, 2]
        assert (path / wan.WEIGHTS_INDEX_NAME).exists() == (name == "sharded")
        ref = diffusers.WanTransformer3DModel.from_pretrained(str(path)).eval()
        with torch.no_grad():
            errors = [(ref(hidden_states=x[None], timestep=t[None], encoder_hidden_states=c[None],
                           return_dict=False)[0][0] - m).abs().max().item()
                      for x, t, c, m in zip(latents, timesteps, texts, mine)]  # fmt: skip
        print(f"save_wan_dit ({name}) -> diffusers from_pretrained: max abs error per clip {errors}")
        assert max(errors) < ATOL
        back = wan.load_wan_dit(path).state_dict()
        assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
        assert _verify(path, capsys)[0] == 0
    # re-exporting into a folder replaces its files: no stale shards beside a single file
    wan.save_wan_dit(ours, tmp_path / "sharded")
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["config.json", wan.WEIGHTS_NAME]
    half = wan.save_wan_dit(ours, tmp_path / "bf16", dtype=torch.bfloat16)
    assert diffusers.WanTransformer3DModel.from_pretrained(str(half)).dtype == torch.float32  # diffusers' default
    from safetensors import safe_open

    with safe_open(str(half / wan.WEIGHTS_NAME), framework="pt") as st:
        assert st.get_tensor("proj_out.weight").dtype == torch.bfloat16
