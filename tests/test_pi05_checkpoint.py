"""Pi0.5 checkpoints in lerobot's layout (models/hf/pi05.py): a tiny policy directory written here
by hand under lerobot 0.4.4's key names (with and without the ``model.`` prefix lerobot's own saves
carry), loaded by name, checked tensor by tensor against rules written in this test, exported and
loaded again bit for bit; key mismatches either way are fatal and named (lerobot#1406).

Sizes are not round and come from variants registered for the test (lerobot's are fixed names):
backbone width 48, 2 layers, 3 heads of head_dim 20 over 1 kv head, MLP 72, vocabulary 301;
expert width 32, MLP 40; SigLIP width 42 in 3 heads, MLP 50, 2 blocks, 42 px images of 14 px
patches; chunks of 4 actions of 5 dims.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniweave.models.hf import pi05
from omniweave.models.hf.loading import load_hf, load_hf_into
from omniweave.models.hf.verify_paligemma import patches
from omniweave.models.registry import build_model

PALI = "paligemma_with_expert.paligemma.model."
TOWER = PALI + "vision_tower.vision_model."
EXP = "paligemma_with_expert.gemma_expert.model."
V, W, E, VW, H, A, LAYERS, BLOCKS = 301, 48, 32, 42, 4, 5, 2, 2
CONFIG = {"type": "pi05", "paligemma_variant": "tiny_backbone", "action_expert_variant": "tiny_expert",
          "chunk_size": H, "n_action_steps": 3, "max_action_dim": A, "max_state_dim": 7, "tokenizer_max_length": 31,
          "image_resolution": [42, 42], "num_inference_steps": 3, "dtype": "float32",
          "input_features": {"observation.state": {"type": "STATE", "shape": [6]},
                             "observation.images.top": {"type": "VISUAL", "shape": [3, 42, 42]}},
          "output_features": {"action": {"type": "ACTION", "shape": [A]}}, "optimizer_lr": 2.5e-5}  # fmt: skip


@pytest.fixture(autouse=True)
def tiny_variants(monkeypatch):
    monkeypatch.setitem(pi05.GEMMA_VARIANTS, "tiny_backbone", {"width": W, "depth": LAYERS, "mlp_dim": 72,
                        "num_heads": 3, "num_kv_heads": 1, "head_dim": 20})  # fmt: skip
    monkeypatch.setitem(pi05.GEMMA_VARIANTS, "tiny_expert", {"width": E, "depth": LAYERS, "mlp_dim": 40,
                        "num_heads": 3, "num_kv_heads": 1, "head_dim": 20})  # fmt: skip
    monkeypatch.setattr(pi05, "PALIGEMMA", {"vocab_size": V, "vision": {"hidden_size": VW, "intermediate_size": 50,
                        "depth": BLOCKS, "num_heads": 3, "patch_size": 14, "image_size": 42}})  # fmt: skip


def lerobot_shapes() -> dict[str, tuple[int, ...]]:
    """Every key of a tiny Pi0.5 state dict, as lerobot 0.4.4 names it (no ``model.`` prefix)."""
    s = {TOWER + "embeddings.patch_embedding.weight": (VW, 3, 14, 14), TOWER + "embeddings.patch_embedding.bias": (VW,),
         TOWER + "embeddings.position_embedding.weight": (9, VW), TOWER + "post_layernorm.weight": (VW,),
         TOWER + "post_layernorm.bias": (VW,), PALI + "multi_modal_projector.linear.weight": (W, VW),
         PALI + "multi_modal_projector.linear.bias": (W,), PALI + "language_model.embed_tokens.weight": (V, W),
         PALI + "language_model.norm.weight": (W,), EXP + "norm.dense.weight": (3 * E, E), EXP + "norm.dense.bias": (3 * E,),
         "action_in_proj.weight": (E, A), "action_in_proj.bias": (E,), "action_out_proj.weight": (A, E),
         "action_out_proj.bias": (A,), "time_mlp_in.weight": (E, E), "time_mlp_in.bias": (E,),
         "time_mlp_out.weight": (E, E), "time_mlp_out.bias": (E,)}  # fmt: skip
    for b in range(BLOCKS):
        blk = f"{TOWER}encoder.layers.{b}."
        for p in ("q", "k", "v", "out"):
            s[f"{blk}self_attn.{p}_proj.weight"], s[f"{blk}self_attn.{p}_proj.bias"] = (VW, VW), (VW,)
        for n in ("layer_norm1", "layer_norm2"):
            s[f"{blk}{n}.weight"], s[f"{blk}{n}.bias"] = (VW,), (VW,)
        s[f"{blk}mlp.fc1.weight"], s[f"{blk}mlp.fc1.bias"] = (50, VW), (50,)
        s[f"{blk}mlp.fc2.weight"], s[f"{blk}mlp.fc2.bias"] = (VW, 50), (VW,)
    for prefix, w, mlp in ((PALI + "language_model.", W, 72), (EXP, E, 40)):
        for i in range(LAYERS):
            lay = f"{prefix}layers.{i}."
            s.update({lay + "self_attn.q_proj.weight": (60, w), lay + "self_attn.k_proj.weight": (20, w),
                      lay + "self_attn.v_proj.weight": (20, w), lay + "self_attn.o_proj.weight": (w, 60),
                      lay + "mlp.gate_proj.weight": (mlp, w), lay + "mlp.up_proj.weight": (mlp, w),
                      lay + "mlp.down_proj.weight": (w, mlp)})  # fmt: skip
            for n in ("input_layernorm", "post_attention_layernorm"):
                if prefix == EXP:
                    s[f"{lay}{n}.dense.weight"], s[f"{lay}{n}.dense.bias"] = (3 * w, w), (3 * w,)
                else:
                    s[f"{lay}{n}.weight"] = (w,)
    return s


def write_policy(path, prefix: str = "model.", lm_head: bool = False, drop=(), extra=None, seed: int = 0):
    """A lerobot policy directory; returns its tensors under their file keys."""
    g = torch.Generator().manual_seed(seed)
    tensors = {prefix + k: torch.randn(shape, generator=g) * 0.1 for k, shape in lerobot_shapes().items()}
    if lm_head:
        tensors[f"{prefix}paligemma_with_expert.paligemma.lm_head.weight"] = tensors[f"{prefix}{PALI}language_model.embed_tokens.weight"].clone()
    for k in drop:
        tensors.pop(prefix + k)
    tensors.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return tensors


def ours_of(key: str) -> tuple[str, slice | None]:
    """This test's own reading of a (prefix-free) lerobot key: our tensor and, for a SigLIP q / k / v,
    its rows in the fused qkv."""
    if key.startswith(TOWER):
        rest = key[len(TOWER):]
        for theirs, mine in (("embeddings.patch_embedding", "patch_embed"), ("embeddings.position_embedding",
                             "position_embedding"), ("layer_norm1", "norm1"), ("layer_norm2", "norm2"),
                             ("self_attn.out_proj", "attn.proj"), ("encoder.layers", "blocks")):  # fmt: skip
            rest = rest.replace(theirs, mine)
        for i, p in enumerate("qkv"):
            if f"self_attn.{p}_proj" in rest:
                return "image_encoder." + rest.replace(f"self_attn.{p}_proj", "attn.qkv"), slice(i * VW, (i + 1) * VW)
        return "image_encoder." + rest, None
    if key.startswith(PALI + "multi_modal_projector."):
        return "projector." + key[len(PALI + "multi_modal_projector."):], None
    if key.startswith(PALI + "language_model."):
        return "foundation." + key[len(PALI + "language_model."):], None
    if key.startswith(EXP):
        return "action_expert." + key[len(EXP):], None
    return "action_expert." + key, None


def velocity(model, seed: int = 3) -> torch.Tensor:
    """The expert's velocity on a packed row of two observations (9 image tokens + text each)."""
    g = torch.Generator().manual_seed(seed)
    lengths, prefix_lens = [15, 12], [13, 12]
    starts = torch.tensor([0, *lengths]).cumsum(0)
    ids = torch.randint(3, 290, (sum(lengths),), generator=g)
    batch = {"input_ids": ids, "labels": torch.full_like(ids, -100),
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "cu_seqlens": starts.to(torch.int32),
             "pixel_values": patches(torch.randn(2, 3, 42, 42, generator=g), 14), "grid_thw": torch.tensor([[1, 3, 3]] * 2),
             "media_spans": torch.tensor([[int(s), 9] for s in starts[:-1]]), "prefix_lens": torch.tensor(prefix_lens)}  # fmt: skip
    prefix = model.prefix(batch)
    chunks = model.chunks(prefix, torch.arange(2))
    return model.velocity(chunks, torch.randn(2, H, A, generator=g), torch.tensor([0.3, 0.8]))


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_every_tensor_lands_by_name(tmp_path, prefix):
    written = write_policy(tmp_path / "p", prefix)
    model, cfg = pi05.load_pi05(tmp_path / "p")
    state = model.state_dict()
    for key, t in written.items():
        ours, rows = ours_of(key[len(prefix):])
        assert torch.equal(state[ours] if rows is None else state[ours][rows], t), key
    assert torch.equal(state["foundation.lm_head.weight"], written[f"{prefix}{PALI}language_model.embed_tokens.weight"])
    e = cfg["action_expert"]
    assert (e["horizon"], e["action_dim"], e["num_steps"], e["hidden_size"]) == (H, A, 3, E)
    assert type(model).__name__ == "VLAModel" and cfg["foundation"]["vocab_size"] == V


def test_our_names_are_transformers_in_memory_names():
    """The hand-written PaliGemma keys are what PaliGemmaForConditionalGeneration holds in memory
    (lerobot 0.4.4 runs openpi's transformers 4.53, whose SigLIP tower keeps a ``vision_model.``
    level that transformers 5 drops; both spellings load)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    hf = PaliGemmaForConditionalGeneration(PaliGemmaConfig(
        text_config={"model_type": "gemma", "vocab_size": V, "hidden_size": W, "intermediate_size": 72,
                     "num_hidden_layers": LAYERS, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 20},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": VW, "num_hidden_layers": BLOCKS,
                       "num_attention_heads": 3, "intermediate_size": 50, "image_size": 42, "patch_size": 14,
                       "vision_use_head": False}, projection_dim=W, image_token_index=290))  # fmt: skip
    theirs = {"paligemma_with_expert.paligemma." + k.replace("model.vision_tower.", "model.vision_tower.vision_model."):
              tuple(v.shape) for k, v in hf.state_dict().items()}  # fmt: skip
    ours = {k: v for k, v in lerobot_shapes().items() if k.startswith("paligemma_with_expert.paligemma.")}
    assert {k: v for k, v in theirs.items() if not k.endswith("lm_head.weight")} == ours


def test_export_round_trip_is_bit_identical(tmp_path):
    written = write_policy(tmp_path / "a", "model.", lm_head=True)
    model, _ = pi05.load_pi05(tmp_path / "a")
    model.eval()
    out = pi05.export_pi05(model, tmp_path / "b")
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(written)
    assert all(torch.equal(exported[k], written[k]) for k in written)
    again, _ = pi05.load_pi05(out)
    again.eval()
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(velocity(model), velocity(again))
    cfg = json.loads((out / "config.json").read_text())
    for key in ("type", "paligemma_variant", "action_expert_variant", "chunk_size", "n_action_steps", "max_action_dim",
                "max_state_dim", "tokenizer_max_length", "image_resolution", "input_features", "output_features",
                "optimizer_lr", "num_inference_steps"):  # fmt: skip
        assert cfg[key] == CONFIG[key], key
    assert (cfg["dtype"], cfg["min_period"], cfg["time_sampling_beta_alpha"]) == ("float32", 4e-3, 1.5)


@pytest.mark.parametrize("layout", ["lm_head_only", "unused_expert_head"])
def test_tolerated_layouts(tmp_path, layout):
    """A tied pair saved as lm_head only (safetensors' save_model keeps one), and the expert's unused
    lm_head, load; the model is the same as from the plain layout."""
    emb = PALI + "language_model.embed_tokens.weight"
    plain = write_policy(tmp_path / "plain", "")
    if layout == "lm_head_only":
        write_policy(tmp_path / "x", "", lm_head=True, drop=[emb])
    else:
        write_policy(tmp_path / "x", "", extra={"paligemma_with_expert.gemma_expert.lm_head.weight": torch.zeros(V, E)})
    got = pi05.load_pi05(tmp_path / "x")[0].state_dict()
    assert torch.equal(got["foundation.embed_tokens.weight"], plain[emb])
    ref = pi05.load_pi05(tmp_path / "plain")[0].state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_init_from_reads_a_policy_directory(tmp_path, prefix):
    """train.init_from=DIR (load_hf_into, each tensor read in place) fills a model built from the
    recipe section exactly as the whole-model load does, from either key spelling."""
    write_policy(tmp_path / "p", prefix, lm_head=True, drop=[PALI + "language_model.embed_tokens.weight"])
    ref, cfg = load_hf(tmp_path / "p")
    fresh = build_model(cfg)
    assert load_hf_into(fresh, tmp_path / "p") > 0
    a, b = ref.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", ["missing", "missing_qkv", "extra_layer", "extra_unknown"])
@pytest.mark.parametrize("loader", ["load", "init_from"])
def test_key_mismatches_are_fatal_and_named(tmp_path, case, loader):
    key = {"missing": EXP + "layers.1.mlp.up_proj.weight", "missing_qkv": TOWER + "encoder.layers.1.self_attn.k_proj.bias",
           "extra_layer": EXP + "layers.2.mlp.up_proj.weight", "extra_unknown": "state_proj.weight"}[case]  # fmt: skip
    if case.startswith("missing"):
        write_policy(tmp_path / "p", "model.", drop=[key])
    else:
        write_policy(tmp_path / "p", "model.", extra={"model." + key: torch.zeros(3)})
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        if loader == "load":
            pi05.load_pi05(tmp_path / "p")
        else:
            cfg = pi05.model_config(CONFIG)
            load_hf_into(build_model(cfg), tmp_path / "p")


def test_export_refuses_sizes_lerobot_cannot_name(tmp_path):
    write_policy(tmp_path / "p")
    model, cfg = pi05.load_pi05(tmp_path / "p")
    pi05.GEMMA_VARIANTS.pop("tiny_expert")  # restored by monkeypatch
    with pytest.raises(ValueError, match="action expert"):
        pi05.export_pi05(model, tmp_path / "out")


def test_pi05_recipe_is_lerobots_default_policy(monkeypatch):
    """The pi05 recipe builds on meta with 3,353,433,872 parameters (lerobot's 3.62B less the expert's
    unused lm_head), exports as gemma_2b + gemma_300m, and lerobot's default PI05Config reads back
    into the same tensors and shapes."""
    from omniweave.config import load_recipe, to_dict

    monkeypatch.undo()  # lerobot's own variants and SigLIP tower
    with torch.device("meta"):
        model = build_model(to_dict(load_recipe("pi05", ["data.path=x"]).model))
    assert sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) == 3_353_433_872
    lr = pi05.config_to_lerobot(model)
    assert (lr["paligemma_variant"], lr["action_expert_variant"], lr["chunk_size"], lr["max_action_dim"]) == \
        ("gemma_2b", "gemma_300m", 50, 32)
    with torch.device("meta"):
        back = build_model(pi05.model_config({"type": "pi05"}))
    assert {k: v.shape for k, v in back.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_hf_export_cli_writes_a_lerobot_directory(tmp_path, capsys):
    """`omniweave hf export CKPT --output DIR` of a VLA checkpoint writes lerobot's layout (the
    default for a VLA model, or --format lerobot); --format hf is refused in one line."""
    from omniweave.cli import main
    from omniweave.models.hf.export import save_checkpoint_dir

    written = write_policy(tmp_path / "p", "")
    model, cfg = pi05.load_pi05(tmp_path / "p")
    save_checkpoint_dir(model, cfg, tmp_path / "ckpt")
    assert main(["hf", "export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--format", "lerobot"]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == {"model." + k for k in written} | {f"model.{PALI[:-len('model.')]}lm_head.weight"}
    assert all(torch.equal(exported["model." + k], t) for k, t in written.items())
    assert main(["hf", "export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert "only --format lerobot" in capsys.readouterr().err
