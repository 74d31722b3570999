"""LoRA export in PEFT's format (hf/peft_adapter.py) against peft itself, on a tiny random Qwen2-VL:
adapters on the decoder (every Linear) and the vision tower (qkv, fc1), the projector trained in
full (PEFT's modules_to_save). ``hf export --adapter`` -> transformers model of ``DIR/base`` +
``peft.PeftModel.from_pretrained(…, DIR/adapter)`` gives omniweave's logits within 1e-4; the
tensor names and config are the ones peft writes itself for the same adapters; the merged export
equals the adapted model; ``hf verify --adapter`` passes, and refuses an adapter of another base.

Mixed runs (components adapted, trained in full, frozen; trained a few real steps from a HF base):
modules_to_save holds each fully trained part at its outermost module and PEFT over the base gives
the merged export's logits; a tensor transformers stores split is saved in pieces; what PEFT
cannot carry is refused at export, and what PEFT cannot load at ``hf verify``, in one line."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch

from omniweave.errors import UserError
from omniweave.models import lora
from omniweave.models.hf import export as export_mod
from omniweave.models.hf.export import save_checkpoint_dir
from omniweave.models.hf.loading import load_hf
from tests.vl_factory import hf_class, hf_inputs, hf_position_ids, make_sample, save_tiny

peft = pytest.importorskip("peft")

LORA = {"foundation": {"r": 4, "alpha": 8, "targets": "all-linear"},
        "image_encoder": {"r": 2, "alpha": 6, "targets": ["qkv", "fc1"]}}
SAMPLE = [("image", (1, 4, 6)), ("video", (2, 4, 4))]
ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(adapted omniweave model, export dir, source HF dir): the checkpoint exported with --adapter."""
    root = tmp_path_factory.mktemp("peft")
    src = save_tiny("qwen2_vl", root / "src")
    model = _adapted_checkpoint(src, {s: {"lora": spec} for s, spec in LORA.items()}, ("projector",), root / "ckpt")
    assert _export(root / "ckpt", root / "out", "--adapter") == 0
    return model.eval(), root / "out", src


def _adapted_checkpoint(src, sections: dict, trained: tuple[str, ...], ckpt, seed: int = 7):
    """``src`` with the recipe's ``sections`` (lora, freeze), its adapters' B random and the
    ``trained`` components moved as training in full would, saved as the checkpoint ``ckpt``."""
    model, cfg = load_hf(src)
    cfg = copy.deepcopy(cfg)
    for section, extra in sections.items():
        cfg[section].update(copy.deepcopy(extra))
    lora.apply_lora(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in lora.adapted_linears(model):
            m.lora_B.weight.normal_(std=0.05)
        for section in trained:
            for p in getattr(model, section).parameters():
                p.add_(0.05 * torch.randn_like(p))
    save_checkpoint_dir(model, cfg, ckpt)
    return model


def _export(ckpt, out, *flags) -> int:
    parser = argparse.ArgumentParser()
    export_mod.add_arguments(parser)
    return export_mod.run(parser.parse_args([str(ckpt), "--output", str(out), *flags]))


def _logits(hf, ours, sample):
    batch = {k: v for k, v in sample.items() if k != "kinds"}
    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    batch["position_ids"] = hf_position_ids(base, sample)
    with torch.no_grad():
        return hf(**hf_inputs(sample)).logits[0], ours.logits(batch)


def test_peft_loads_the_adapter_with_omniweaves_logits(exported):
    ours, out, _ = exported
    base = hf_class("qwen2_vl").from_pretrained(out / "base", attn_implementation="eager").eval()
    with torch.no_grad():
        plain_ref, _ = _logits(base, ours, make_sample(SAMPLE, seed=2))
    model = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ref, got = _logits(model, ours, make_sample(SAMPLE, seed=2))
    diff = float((ref - got).abs().max())
    print(f"PEFT round trip: max |Δlogits| = {diff:.2e}")
    assert diff <= ATOL
    assert float((ref - plain_ref).abs().max()) > 100 * ATOL  # the adapter and projector change the logits


def test_adapter_files_match_what_peft_writes(exported, tmp_path):
    """peft's own save of the same adapters on the transformers model: same tensor names and
    shapes, same LoRA config fields."""
    _, out, _ = exported
    ours_cfg = json.loads((out / "adapter/adapter_config.json").read_text())
    base = hf_class("qwen2_vl").from_pretrained(out / "base")
    config = peft.LoraConfig(r=ours_cfg["r"], lora_alpha=ours_cfg["lora_alpha"], target_modules=ours_cfg["target_modules"],
                             rank_pattern=ours_cfg["rank_pattern"], alpha_pattern=ours_cfg["alpha_pattern"],
                             modules_to_save=ours_cfg["modules_to_save"])
    peft.get_peft_model(base, config).save_pretrained(tmp_path / "peft")
    from safetensors import safe_open

    def shapes(path):
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(out / "adapter/adapter_model.safetensors") == shapes(tmp_path / "peft/adapter_model.safetensors")
    theirs = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert sorted(ours_cfg["target_modules"]) == sorted(theirs["target_modules"])  # peft writes a set's order
    for key in ("peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "modules_to_save",
                "bias", "fan_in_fan_out", "use_rslora", "use_dora", "task_type", "auto_mapping"):
        assert ours_cfg[key] == theirs[key], key
    assert ours_cfg["modules_to_save"] == ["model.visual.merger"]
    assert "model.visual.blocks.0.attn.qkv" in ours_cfg["target_modules"]
    assert ours_cfg["rank_pattern"] == {f"model.visual.blocks.{i}.{m}": 2 for i in range(2) for m in ("attn.qkv", "mlp.fc1")}


def test_merged_export_equals_the_adapter_model(exported, tmp_path):
    ours, out, _ = exported
    assert _export(out.parent / "ckpt", tmp_path / "merged") == 0
    hf = hf_class("qwen2_vl").from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ref, got = _logits(hf, ours, make_sample(SAMPLE, seed=3))
    assert float((ref - got).abs().max()) <= ATOL


def test_verify_adapter_passes_and_refuses_another_base(exported, tmp_path, capsys):
    from omniweave.models.hf import verify

    _, out, _ = exported
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    assert verify.run(parser.parse_args([str(out / "base"), "--adapter", str(out / "adapter")])) == 0
    assert "OK: all differences within atol" in capsys.readouterr().out
    other = save_tiny("qwen2_5_vl", tmp_path / "other")  # another base: its ViT's MLP is gate / up / down
    with pytest.raises(UserError, match=r"exported for another base model.*model.visual.blocks.0.mlp.fc1: "
                                        r"A \[2, 32\], B \[64, 2\] \(no such Linear\)"):
        verify.run(parser.parse_args([str(other), "--adapter", str(out / "adapter")]))


def test_adapter_export_of_a_model_without_adapters_is_refused(tmp_path):
    src = save_tiny("qwen2_vl", tmp_path / "src")
    model, cfg = load_hf(src)
    save_checkpoint_dir(model, cfg, tmp_path / "ckpt")
    with pytest.raises(UserError, match="no LoRA adapters"):
        _export(tmp_path / "ckpt", tmp_path / "out", "--adapter")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_text_model_adapter_over_its_init_from_base(family, tmp_path):
    """A decoder-only model that started from a HF directory (``train.init_from``): no base/ is
    written, the adapter names that directory, and peft over it gives omniweave's logits."""
    from omniweave.models.hf.peft_adapter import export_adapter
    from tests.hf_factory import save_tiny as save_tiny_text

    hf = save_tiny_text(family, tmp_path / "src")
    model, cfg = load_hf(tmp_path / "src")
    cfg = copy.deepcopy(cfg)
    cfg["foundation"]["lora"] = {"r": 3, "alpha": 5, "targets": ["q_proj", "down_proj"]}
    lora.apply_lora(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, m in lora.adapted_linears(model):
            m.lora_B.weight.normal_(std=0.05)
    ids = torch.randint(0, 1024, (17,))
    with torch.no_grad():
        want = model.eval().logits({"input_ids": ids})
    export_adapter(model, cfg, tmp_path / "out", base_dir=str(tmp_path / "src"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter"]
    config = json.loads((tmp_path / "out/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "src").resolve())
    assert "model.layers.1.mlp.down_proj" in config["target_modules"] and config["lora_alpha"] == 5
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf.eval(), str(tmp_path / "out/adapter")).eval()(input_ids=ids[None]).logits[0]
    assert float((got - want).abs().max()) <= ATOL


# ----------------------------------------------------------------------------- mixed runs
# A run that started from a HF directory (``train.init_from``) with some components adapted, some
# trained in full and some frozen. Real gradient steps move the trained ones away from the base,
# so an adapter that leaves them out (or that PEFT cannot load) fails the comparison.

ADAPT = {"foundation": {"lora": {"r": 4, "alpha": 8}},
         "image_encoder": {"lora": {"r": 2, "alpha": 6, "targets": ["qkv", "fc1"]}}}
FREEZE = {"freeze": True}
MIXES = {  # id: (recipe model sections, tied embeddings, modules_to_save)
    "foundation_lora_vision_trained": ({"foundation": ADAPT["foundation"]}, False, ["model.visual"]),
    "foundation_lora_vision_frozen": ({"foundation": ADAPT["foundation"], "image_encoder": FREEZE, "projector": FREEZE},
                                      False, None),
    "lora_on_both_projector_trained": (ADAPT, False, ["model.visual.merger"]),
    "foundation_lora_vit_trained_merger_frozen": ({"foundation": ADAPT["foundation"], "projector": FREEZE}, False,
                                                  ["model.visual.blocks.0", "model.visual.blocks.1",  # a ModuleList: PEFT
                                                   "model.visual.patch_embed"]),                      # keeps its children
    "vision_lora_tied_foundation_trained": ({"image_encoder": ADAPT["image_encoder"], "projector": FREEZE}, True,
                                            ["lm_head", "model.language_model"]),
}


def _with_init_from(ckpt, src) -> None:
    """Name ``src`` as the checkpoint's ``train.init_from`` (its base for ``hf export --adapter``)."""
    import yaml

    recipe = yaml.safe_load((ckpt / "config.yaml").read_text())
    (ckpt / "config.yaml").write_text(yaml.safe_dump({**recipe, "train": {"init_from": str(src)}}, sort_keys=False))


def _trained_checkpoint(src, sections: dict, ckpt, steps: int = 3):
    """A checkpoint of ``src`` trained ``steps`` AdamW steps with the recipe's ``sections`` (freeze,
    lora), its recipe naming ``src`` as ``train.init_from`` (so ``hf export --adapter`` takes src as the base)."""
    from omniweave.models.hf.loading import adapter_for, load_hf_into, read_hf_config
    from omniweave.models.registry import build_model

    cfg = adapter_for(read_hf_config(src)["model_type"]).model_config(read_hf_config(src))
    for section, extra in sections.items():
        cfg[section].update(copy.deepcopy(extra))
    torch.manual_seed(0)
    model = build_model(cfg)  # the recipe's freezing and adapters
    load_hf_into(model, src)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        sample = make_sample(SAMPLE, seed=10 + step)
        batch = {k: v for k, v in sample.items() if k != "kinds"}
        torch.nn.functional.cross_entropy(model.logits(batch), sample["labels"], ignore_index=-100).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint_dir(model, cfg, ckpt)
    _with_init_from(ckpt, src)
    return model


def _export_mix(mix: str, root):
    """``root/src`` (the base), ``root/ckpt`` trained as ``MIXES[mix]`` says, ``root/peft/adapter``; returns src."""
    sections, tie, _ = MIXES[mix]
    src = save_tiny("qwen2_vl", root / "src", tie=tie)
    _trained_checkpoint(src, sections, root / "ckpt")
    assert _export(root / "ckpt", root / "peft", "--adapter") == 0
    return src


@pytest.mark.parametrize("mix", MIXES)
def test_mixed_run_adapter_gives_the_merged_export_through_peft(mix, tmp_path):
    """``hf export --adapter`` of a mixed run: modules_to_save holds each fully trained part at its
    outermost module (no nesting, nothing frozen or adapted in it), and PEFT over the untouched base
    gives the merged export's logits (transformers) within 1e-4; so does our own loader."""
    from omniweave.models.hf.peft_adapter import load_adapter

    src = _export_mix(mix, tmp_path)
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter"]  # the base is src
    want_saved = MIXES[mix][2]
    config = json.loads((tmp_path / "peft/adapter/adapter_config.json").read_text())
    assert config["modules_to_save"] == want_saved
    assert _export(tmp_path / "ckpt", tmp_path / "merged") == 0

    sample = make_sample(SAMPLE, seed=2)
    hf = hf_class("qwen2_vl")
    merged = hf.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    base = hf.from_pretrained(src, attn_implementation="eager").eval()
    with torch.no_grad():
        want = merged(**hf_inputs(sample)).logits[0]
        assert float((base(**hf_inputs(sample)).logits[0] - want).abs().max()) > 100 * ATOL  # training moved it
        got = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft/adapter")).eval()(**hf_inputs(sample)).logits[0]
    diff = float((got - want).abs().max())
    print(f"{mix}: PEFT over the base vs the merged export: max |Δlogits| = {diff:.2e}")
    assert diff <= ATOL

    ours, _ = load_hf(src)
    load_adapter(ours, tmp_path / "peft/adapter")
    _, mine = _logits(merged, ours.eval(), sample)
    assert float((mine - want).abs().max()) <= ATOL


def test_modules_to_save_are_the_outermost_wholly_trained_modules():
    """The choice alone (names only): a module is kept when everything in it trains in full (buffers
    aside), the outermost such; never the model itself, a container PEFT cannot wrap, or anything
    holding a frozen or adapted tensor."""
    from omniweave.models.hf.peft_adapter import ADAPTED, BUFFER, FROZEN, TRAINED, modules_to_save

    status = {"model.visual.patch_embed.proj.weight": TRAINED, "model.visual.blocks.0.attn.qkv.weight": TRAINED,
              "model.visual.blocks.1.norm.weight": TRAINED, "model.visual.rope.inv_freq": BUFFER,
              "model.visual.merger.mlp.0.weight": TRAINED, "model.lm.layers.0.q.weight": ADAPTED,
              "model.lm.layers.0.q.bias": ADAPTED, "model.lm.norm.weight": FROZEN, "lm_head.weight": FROZEN}
    assert modules_to_save(status) == ["model.visual"]  # not model.visual.merger again inside it
    status["model.visual.merger.mlp.0.weight"] = FROZEN
    assert modules_to_save(status) == ["model.visual.blocks", "model.visual.patch_embed"]
    assert modules_to_save(status, {"model.visual.blocks"}) == ["model.visual.blocks.0", "model.visual.blocks.1",
                                                                 "model.visual.patch_embed"]
    status["model.lm.norm.weight"] = status["lm_head.weight"] = TRAINED
    assert modules_to_save(status) == ["lm_head", "model.lm.norm", "model.visual.blocks", "model.visual.patch_embed"]
    assert modules_to_save({k: FROZEN for k in status}) == []


@pytest.mark.parametrize("status, message", [
    ({"model.proj.weight": "trained in full", "model.proj.bias": "frozen", "model.other.weight": "frozen"},
     "model.proj.weight is trained in full, but PEFT's modules_to_save keeps whole modules and every module holding it "
     "also holds model.proj.bias (frozen); export this run merged (without --adapter), or train that module's "
     "components alike (all in full, adapters or frozen)"),
    ({"model.block.scale": "trained in full", "model.block.fc.weight": "LoRA-adapted"},
     "model.block.scale is trained in full, but PEFT's modules_to_save keeps whole modules and every module holding it "
     "also holds model.block.fc.weight (LoRA-adapted); export"),
    ({"scale": "trained in full", "model.fc.weight": "frozen"},
     "scale is trained in full but in no module PEFT's modules_to_save can keep (it belongs to the model itself or "
     "to a container); export this run merged (without --adapter)"),
    ({"model.scales.0": "trained in full", "model.fc.weight": "frozen"},  # model.scales: a ParameterList
     "model.scales.0 is trained in full, but PEFT's modules_to_save keeps whole modules and every module holding it "
     "also holds model.fc.weight (frozen)"),
    ({"scales.0": "trained in full", "scales.1": "trained in full"}, "scales.0 is trained in full but in no module"),
])
def test_a_mix_peft_cannot_express_is_refused_in_one_line(status, message):
    from omniweave.models.hf.peft_adapter import modules_to_save

    with pytest.raises(UserError) as e:
        modules_to_save(status, containers={"model.scales", "scales"})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def vision_trained(tmp_path_factory):
    """The reported run: adapters on the foundation, the vision tower and projector trained in full."""
    root = tmp_path_factory.mktemp("vision_trained")
    return _export_mix("foundation_lora_vision_trained", root), root / "peft/adapter"


def _edited(adapter, tmp_path, **config):
    """A copy of ``adapter`` with ``config`` changed in its adapter_config.json."""
    import shutil

    out = shutil.copytree(adapter, tmp_path / "edited")
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return out


@pytest.mark.parametrize("saved, message", [
    (["model.visual", "model.visual.merger"],  # what omniweave wrote before: PEFT fails with a KeyError
     "modules_to_save keeps model.visual.merger inside model.visual, which PEFT cannot load; export the checkpoint "
     "again (omniweave hf export CKPT --output DIR --adapter)"),
    (["merger"], "tensor model.visual.blocks.0.attn.proj.bias is in no module of modules_to_save (merger): PEFT would "
                 "not load it"),
])
def test_hf_verify_refuses_an_adapter_peft_cannot_load_in_one_line(vision_trained, tmp_path, capsys, saved, message):
    from omniweave.cli import main as cli

    src, adapter = vision_trained
    edited = _edited(adapter, tmp_path, modules_to_save=saved)
    capsys.readouterr()
    assert cli(["hf", "verify", str(src), "--adapter", str(edited)]) == 2
    err = capsys.readouterr().err  # transformers' loading bars, then our one line
    assert err.strip().splitlines()[-1] == f"omniweave hf verify: error: {edited}: {message}"
    assert "Traceback" not in err


def test_hf_verify_turns_what_peft_raises_into_one_line(vision_trained, tmp_path, capsys):
    """An adapter our loader reads but peft refuses (its target_modules name no module of the base)."""
    from omniweave.cli import main as cli

    src, adapter = vision_trained
    edited = _edited(adapter, tmp_path, target_modules=["no_such_proj"])
    capsys.readouterr()
    assert cli(["hf", "verify", str(src), "--adapter", str(edited)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"omniweave hf verify: error: {edited}: peft cannot load this "
                                                   f"adapter over {src}: NoMatchingPeftModuleError: No modules were "
                                                   "targeted for adaptation.")
    assert "Traceback" not in err


def test_a_tensor_transformers_stores_split_is_saved_in_its_pieces(tmp_path):
    """Qwen2.5-Omni's vision attention is one ``qkv`` Linear of ours and ``q``, ``k``, ``v`` in
    transformers: with the vision tower trained in full next to decoder adapters, the adapter holds
    the three pieces, so PEFT over the base, merged, equals the merged export tensor for tensor,
    and our loader puts the fused tensor back."""
    import transformers

    from omniweave.models.hf.peft_adapter import load_adapter
    from tests.test_hf_qwen2_5_omni import tiny_thinker

    tiny_thinker().save_pretrained(tmp_path / "src")
    sections = {"foundation": {"lora": {"r": 2}}, "audio_encoder": {"freeze": True}, "audio_projector": {"freeze": True}}
    _adapted_checkpoint(tmp_path / "src", sections, ("image_encoder", "projector"), tmp_path / "ckpt")
    _with_init_from(tmp_path / "ckpt", tmp_path / "src")
    assert _export(tmp_path / "ckpt", tmp_path / "peft", "--adapter") == 0
    assert _export(tmp_path / "ckpt", tmp_path / "merged") == 0
    assert json.loads((tmp_path / "peft/adapter/adapter_config.json").read_text())["modules_to_save"] == ["model.visual"]

    cls = transformers.Qwen2_5OmniThinkerForConditionalGeneration
    want = cls.from_pretrained(tmp_path / "merged").state_dict()
    got = peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "src"), str(tmp_path / "peft/adapter"))
    got = got.merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-6
    ours, _ = load_hf(tmp_path / "src")
    load_adapter(ours, tmp_path / "peft/adapter")
    lora.merge_adapters(ours)
    merged, _ = load_hf(tmp_path / "merged")
    assert max(float((t - merged.state_dict()[k]).abs().max()) for k, t in ours.state_dict().items()) <= 1e-6


def test_a_trained_tensor_peft_cannot_carry_is_refused_at_export(tmp_path, capsys):
    """Qwen3-VL-MoE with its decoder trained in full next to vision adapters: transformers fuses the
    experts its own way, which modules_to_save cannot carry; ``hf export --adapter`` says so in one
    line (exit 2) and writes nothing."""
    from omniweave.cli import main as cli
    from tests.qwen3_vl_factory import save_tiny as save_qwen3_vl

    src, _ = save_qwen3_vl("qwen3_vl_moe", tmp_path / "src")
    _adapted_checkpoint(src, {"image_encoder": {"lora": {"r": 2}}}, (), tmp_path / "ckpt")
    capsys.readouterr()
    assert cli(["hf", "export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "omniweave hf export: error: foundation.layers.0.mlp.experts.gate_up_proj is trained in full, but the "
        "transformers model holds it in another layout, which PEFT's modules_to_save cannot carry; export this run "
        "merged (without --adapter)")
    assert "Traceback" not in err and not (tmp_path / "out").exists()
