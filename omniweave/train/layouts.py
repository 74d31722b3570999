"""Which training mode runs under which parallel layout: the one place that decides it.

    check(cfg)            a recipe's mode x layout, before any rank starts (the CLI) and again
                          when the engine sets up (in-process runs); LayoutError, one line naming
                          the keys and why, for what cannot run
    refusals(mode, lay)   the reasons, from the objective's traits and the layout's dims
    table()               the mode x layout matrix of docs/training.md (tests/test_layouts.py
                          checks the docs against it)

A mode's traits (:class:`Traits`) are what the executors care about: whether its loss is a sum
over tokens (chunks and CP shards add up; else the sums are carried across chunks,
parallel/seq_chunks.py), whether each row needs a forward of a frozen reference model before its
loss (which a pipeline, holding a slice of the model per rank, cannot run), and whether its loss
sums values over the CP group (DPO's pair sums).
"""

from __future__ import annotations

from dataclasses import dataclass

from omniweave.config import section
from omniweave.errors import UserError


class LayoutError(UserError, ValueError):
    """A training mode and a parallel layout that do not run together; the message says why."""


@dataclass(frozen=True)
class Traits:
    mode: str  # what docs and errors call it: train.phase=sft, train.dpo.ref=model, …
    token_sum: bool = True
    reference_forward: str | None = None  # the keys that ask for a frozen reference's forward per row
    sums_over_cp: bool = False
    action_chunks: bool = False  # VLA: an action expert's chunks read every layer's prefix keys / values (models/vla.py)
    clip_rows: bool = False  # video diffusion: rows of latent clips through a generator (models/diffusion.py)


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    cp: int = 1
    tp: int = 1  # the foundation's (model.foundation.tp)
    expert_tp: int = 1  # model.action_expert.tp: a VLA expert has no tp of its own (it runs on the foundation's)
    seq_chunks: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    moe: bool = False
    mix: bool = False
    cp_attention: str = "ring"

    @classmethod
    def of(cls, cfg) -> "Layout":
        from omniweave.config import to_dict
        from omniweave.models.components.decoder import moe_layer_indices

        model = to_dict(cfg.model)
        par, foundation = section(cfg, "parallel"), (model.get("foundation") or model.get("generator") or {})
        expert = model.get("action_expert") or {}
        return cls(pp=par.pp, cp=par.cp, tp=_int(foundation.get("tp")), expert_tp=_int(expert.get("tp")),
                   seq_chunks=seq_chunks_of(cfg), pp_schedule=par.pp_schedule, pp_virtual=par.pp_virtual,
                   moe=bool(moe_layer_indices(foundation)), mix=(cfg.get("data") or {}).get("mix") is not None,
                   cp_attention=par.cp_attention)


def _int(value) -> int:
    return int(value or 1)


def seq_chunks_of(cfg) -> int:
    """``parallel.seq_chunks`` (1: off), checked to be an integer >= 1."""
    value = section(cfg, "parallel").seq_chunks
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"parallel.seq_chunks={value!r}: the number of chunks a row runs in, an integer >= 1 "
                          "(1: off)")
    return value


def traits(cfg) -> Traits:
    """The traits of the recipe's training mode (``train.phase``, its settings)."""
    train = section(cfg, "train")
    phase = train.phase
    if phase == "dpo":
        ref = train.dpo.ref
        return Traits(f"train.phase=dpo (train.dpo.ref={ref})", token_sum=False,
                      reference_forward="train.dpo.ref=model" if ref == "model" else None, sums_over_cp=True)
    if phase in ("orpo", "simpo"):  # DPO's pair sums without a reference
        return Traits(f"train.phase={phase}", token_sum=False, sums_over_cp=True)
    if phase == "kto":  # per-completion sums; the reference's forward (and z0's pre-pass over the step's rows)
        return Traits("train.phase=kto", token_sum=False, reference_forward="train.phase=kto", sums_over_cp=True)
    if phase == "grpo":
        rl = section(cfg, "rl")
        kl, gspo = float(rl.kl_coef), rl.importance_sampling == "sequence"
        return Traits(f"train.phase=grpo (rl.kl_coef={kl:g}{', rl.importance_sampling=sequence' if gspo else ''})",
                      token_sum=not gspo, reference_forward="rl.kl_coef > 0" if kl > 0 else None, sums_over_cp=gspo)
    if phase == "vla":
        return Traits("train.phase=vla", action_chunks=True)
    if phase == "diffusion":
        return Traits("train.phase=diffusion", clip_rows=True)
    return Traits(f"train.phase={phase}")


def refusals(mode: Traits, lay: Layout) -> list[str]:
    """Why ``mode`` cannot run under ``lay``: one clause per reason, naming the keys ([]: it runs)."""
    out = []
    if mode.clip_rows:  # the generator's rows: whole on each dp rank, or split over cp (parallel/context/sequence.py)
        if lay.cp > 1 and lay.cp_attention not in ("ring", "ulysses"):
            out.append(f"{mode.mode} with parallel.cp_attention={lay.cp_attention}: sequence parallelism over video "
                       "tokens runs ring or ulysses attention; set parallel.cp_attention to one of them")
        for key, value in (("parallel.pp", lay.pp), ("parallel.seq_chunks", lay.seq_chunks)):
            if value > 1:
                out.append(f"{mode.mode} with {key}={value}: a generator's rows run on dp (FSDP), cp (sequence "
                           "parallelism) and tp only so far")
        return out
    if mode.action_chunks:  # the chunks' attention reads every layer's keys / values of whole prefixes
        if lay.expert_tp not in (1, lay.tp):  # the key exists on every component; the expert's would be ignored
            out.append(f"model.action_expert.tp={lay.expert_tp}: the action expert shares the backbone's tp (its "
                       f"queries read the backbone's local key/value heads), model.foundation.tp={lay.tp}; set "
                       "model.foundation.tp and leave model.action_expert.tp at 1")
        for key, value in (("parallel.seq_chunks", lay.seq_chunks), ("parallel.pp", lay.pp)):
            if value > 1:
                out.append(f"{mode.mode} with {key}={value}: the action expert reads every backbone layer's keys "
                           "and values of whole prefixes; not supported yet (use dp, tp or cp)")
        return out
    if lay.seq_chunks > 1:
        n = f"parallel.seq_chunks={lay.seq_chunks}"
        if lay.cp > 1:
            out.append(f"{n} with parallel.cp={lay.cp}: chunked rows and context parallelism both replace the "
                       "decoder's attention; use one of them")
        if lay.tp > 1:
            out.append(f"{n} with model.foundation.tp={lay.tp}: a chunk's K/V store holds whole heads, not a tp "
                       "rank's share; use model.foundation.tp=1")
        if lay.moe:
            out.append(f"{n} with a MoE foundation (model.foundation.num_experts): the router statistics would "
                       "count each chunk's forward sweep and its recompute")
        if lay.pp > 1 and (lay.pp_schedule != "gpipe" or lay.pp_virtual != 1):
            out.append(f"{n} under parallel.pp={lay.pp} runs fill-drain with the backwards in reverse chunk order: "
                       f"set parallel.pp_schedule=gpipe and parallel.pp_virtual=1 (got {lay.pp_schedule}, "
                       f"{lay.pp_virtual})")
    if lay.pp > 1:
        if lay.mix:
            out.append(f"parallel.pp={lay.pp} with data.mix: the stage split reads one packed dataset's statistics "
                       "(data.path)")
        if mode.reference_forward:
            fix = ("store the reference log-probs once with `omniweave dpo precompute-ref` and set "
                   "train.dpo.ref=precomputed, or use train.dpo.ref=none" if "dpo" in mode.reference_forward
                   else "set rl.kl_coef=0" if "rl." in mode.reference_forward
                   else "KTO's reference point is a no-grad pass over the step's rows first; use dp, cp or seq_chunks")
            out.append(f"{mode.reference_forward} under parallel.pp={lay.pp}: the frozen reference's forward of each "
                       f"row would need a pipeline of its own; {fix}")
        if mode.sums_over_cp and lay.cp > 1:
            out.append(f"{mode.mode} under parallel.pp={lay.pp} with parallel.cp={lay.cp}: its per-row log-prob sums "
                       "(pairs', sequences') would be all-reduced over the cp group inside the last stage's schedule")
    return out


def check(cfg) -> None:
    """LayoutError (one line) when the recipe's mode cannot run under its layout."""
    why = refusals(traits(cfg), Layout.of(cfg))
    if why:
        raise LayoutError("; ".join(why))


# ---------------------------------------------------------------------------- the docs' table

MODES = {"SFT / pretraining": Traits("train.phase=sft"),
         "DPO, `ref: model`": Traits("train.phase=dpo (train.dpo.ref=model)", False, "train.dpo.ref=model", True),
         "DPO, `ref: none` / `precomputed`": Traits("train.phase=dpo (train.dpo.ref=none)", False, None, True),
         "ORPO / SimPO": Traits("train.phase=orpo", False, None, True),
         "KTO": Traits("train.phase=kto", False, "train.phase=kto", True),
         "GRPO, `rl.kl_coef: 0`": Traits("train.phase=grpo (rl.kl_coef=0)"),
         "GRPO, `rl.kl_coef > 0`": Traits("train.phase=grpo (rl.kl_coef=0.1)", reference_forward="rl.kl_coef > 0"),
         "GSPO (`rl.importance_sampling: sequence`)": Traits("train.phase=grpo (rl.importance_sampling=sequence)",
                                                            token_sum=False, sums_over_cp=True),
         "VLA (flow matching)": Traits("train.phase=vla", action_chunks=True),
         "Video diffusion (rectified flow)": Traits("train.phase=diffusion", clip_rows=True)}
LAYOUTS = {"dp (FSDP)": Layout(), "cp": Layout(cp=2), "tp": Layout(tp=2), "seq_chunks": Layout(seq_chunks=2),
           "pp": Layout(pp=2), "pp × cp": Layout(pp=2, cp=2), "pp × tp": Layout(pp=2, tp=2),
           "pp × seq_chunks": Layout(pp=2, seq_chunks=2, pp_schedule="gpipe")}


def table() -> str:
    """The mode x layout matrix as a Markdown table: ✓ runs, ✗ refused (the error says why)."""
    head = "| mode | " + " | ".join(LAYOUTS) + " |"
    rule = "|" + "---|" * (len(LAYOUTS) + 1)
    rows = [f"| {name} | " + " | ".join("✗" if refusals(mode, lay) else "✓" for lay in LAYOUTS.values()) + " |"
            for name, mode in MODES.items()]
    return "\n".join([head, rule, *rows])
