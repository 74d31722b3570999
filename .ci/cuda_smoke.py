"""The GPU user's environment, smoke-tested (run by .ci/cuda_env.sh with that venv's python, from a
directory outside the checkout): omniweave installed from its wheel beside the newest torch +
torchvision the registry serves (CUDA builds, on the CPU here).

Each step prints its name and time; the first failure stops with its command's output. Nothing
here imports the checkout: what runs is the installed wheel (checked first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path.cwd()
BIN = Path(sys.executable).parent
OMNI = str(BIN / "omniweave")
DEMO = ["data.path=packed", "data.max_len=1024", "train.warmup=1", "train.log_interval=1"]

# importing omniweave next to torchvision and transformers' torchvision processors, in both orders,
# each in a fresh process: a double registration of torchvision's operators aborts from C++
IMPORTS = {
    "omniweave, then torchvision and HF's video processor": (
        "import sys; hooks = list(sys.meta_path); import omniweave, omniweave.cli, omniweave.config; "
        "assert sys.meta_path == hooks; import torch, torchvision; "
        "from transformers import AutoVideoProcessor, Qwen2_5_VLForConditionalGeneration; "
        "from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor; "
        "from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor; "
        "from omniweave.models.hf import verify, peft_adapter; "
        "from omniweave.models.hf.torchvision_guard import torchvision_loads; assert torchvision_loads(); "
        "keep = torchvision.ops.nms(torch.tensor([[0., 0, 2, 2], [0, 0, 2, 2.1]]), torch.tensor([1., .9]), 0.5); "
        "assert keep.tolist() == [0], keep  # its compiled ops run: nothing was stubbed"),
    "transformers and torchvision, then omniweave": (
        "import torchvision, transformers; from transformers import AutoVideoProcessor, "
        "Qwen2_5_VLForConditionalGeneration; import omniweave; from omniweave.models.hf import verify; "
        "from omniweave.models.hf.torchvision_guard import torchvision_loads; assert torchvision_loads()"),
}


def step(name: str, cmd: list[str], expect: tuple[str, ...] = ()) -> str:
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=900)
    out = r.stdout + r.stderr
    missing = [e for e in expect if e not in out]
    if r.returncode != 0 or missing:
        print(f"FAILED (exit {r.returncode}{', missing ' + repr(missing) if missing else ''}): {' '.join(cmd)}\n"
              f"{out[-6000:]}", flush=True)
        raise SystemExit(1)
    print(f"   ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def main() -> None:
    import omniweave
    import torch

    where = Path(omniweave.__file__).resolve()
    assert where.is_relative_to(Path(sys.prefix).resolve()), f"omniweave imported from {where}, not the venv"
    print(f"omniweave {omniweave.__version__} from {where.parent}; torch {torch.__version__}", flush=True)
    for name, code in IMPORTS.items():
        step(f"imports: {name}", [sys.executable, "-c", code])
    step("omniweave check --device cpu --quick", [OMNI, "check", "--device", "cpu", "--quick"])
    step("data demo", [OMNI, "data", "demo", "data", "--samples", "64", "--eval-samples", "8"])
    step("data convert", [OMNI, "data", "convert", "--input", "data/train.jsonl", "--media-dir", "data/media",
                          "--output", "raw", "--workers", "1", "--no-progress"])
    step("data pack --recipe demo (built in, found by name)",
         [OMNI, "data", "pack", "--input", "raw", "--output", "packed", "--recipe", "demo", "--max-len", "1024",
          "--workers", "1"], expect=("packed 64/64 samples",))
    step("train 3 steps", [OMNI, "train", "demo", *DEMO, "output_dir=run", "train.steps=3", "train.global_batch=2"],
         expect=("trained 3 steps",))
    step("hf export", [OMNI, "hf", "export", "run", "--output", "hf"])
    step("hf verify (an image and a video; HF's torchvision video processor as the reference)",
         [OMNI, "hf", "verify", "hf"],
         expect=("videos: omniweave.data.media.vision vs Qwen2VLVideoProcessor", "OK: all differences within atol"))
    # Qwen3-VL samples and resizes videos its own way (frame_sampling: qwen3_vl): the tiny recipe on the
    # same raw shards, exported, verified against transformers' Qwen3VLVideoProcessor picking its own frames
    step("data pack --recipe tiny_qwen3_vl",
         [OMNI, "data", "pack", "--input", "raw", "--output", "packed_qwen3_vl", "--recipe", "tiny_qwen3_vl",
          "--max-len", "1024", "--workers", "1"], expect=("packed 64/64 samples",))
    step("train tiny_qwen3_vl 2 steps", [OMNI, "train", "tiny_qwen3_vl", "data.path=packed_qwen3_vl", *DEMO[1:],
                                         "output_dir=run_qwen3_vl", "train.steps=2", "train.global_batch=2"],
         expect=("trained 2 steps",))
    step("hf export (Qwen3-VL)", [OMNI, "hf", "export", "run_qwen3_vl", "--output", "hf_qwen3_vl"])
    step("hf verify (Qwen3-VL: an image and a video; HF's Qwen3VLVideoProcessor picks the frames)",
         [OMNI, "hf", "verify", "hf_qwen3_vl"],
         expect=("frame_indices max|Δ| = 0.000e+00", "videos: omniweave.data.media.vision vs Qwen3VLVideoProcessor",
                 "OK: all differences within atol"))
    # the families whose images are tiled (InternVL, LLaVA-OneVision): packed from the same raw shards,
    # trained, exported with their processors, verified against transformers' own processors
    for recipe, family in (("tiny_internvl", "InternVL"), ("tiny_llava_onevision", "LLaVA-OneVision")):
        step(f"data pack --recipe {recipe}", [OMNI, "data", "pack", "--input", "raw", "--output", f"packed_{recipe}",
                                              "--recipe", recipe, "--max-len", "1024", "--workers", "1"],
             expect=("packed 64/64 samples",))  # fmt: skip
        step(f"train {recipe} 2 steps", [OMNI, "train", recipe, f"data.path=packed_{recipe}", *DEMO[1:],
                                          f"output_dir=run_{recipe}", "train.steps=2", "train.global_batch=2"],
             expect=("trained 2 steps",))  # fmt: skip
        step(f"hf export ({family})", [OMNI, "hf", "export", f"run_{recipe}", "--output", f"hf_{recipe}"])
        step(f"hf verify ({family}: its own image processor, the exported chat template)",
             [OMNI, "hf", "verify", f"hf_{recipe}"], expect=("pixel_values  max|Δ| = 0.000e+00", "OK: all differences within atol"))
    step("train --nproc 2 (dp 2)", [OMNI, "train", "demo", *DEMO, "output_dir=run_dp2", "train.steps=2",
                                     "train.global_batch=2", "--nproc", "2"], expect=("cpu x2 (dp=2", "trained 2 steps"))
    step("train --nproc 2 parallel.cp=2", [OMNI, "train", "demo", *DEMO, "output_dir=run_cp2", "train.steps=2",
                                            "train.global_batch=1", "parallel.cp=2", "--nproc", "2"],
         expect=("cp=2 ring", "trained 2 steps"))
    print(f"cuda-env smoke: all passed (python {sys.version.split()[0]}, {os.cpu_count()} cores)", flush=True)


if __name__ == "__main__":
    main()
