"""Benchmark: audio token counting from headers, log-mel extraction (omniweave/data/media/audio.py, mel.py)
and the audio towers (omniweave/models/components/audio_encoder.py).

Three measurements, each against its baseline in the same run, on the same files / clips:

(a) **token counting** of ``--files`` real audio files (wav, flac, mp3, m4a, ogg/opus; 8-48 kHz,
    mono and stereo, ``--seconds`` long each, written with PyAV's encoders, in memory):

    - ``header``: ``probe_audio`` + ``audio_tokens`` for Qwen2-Audio and Qwen2.5-Omni (what
      packing does: no sample is decoded);
    - ``decode + mel (ours)``: ``load_audio`` + ``log_mel`` (128 bins, the Qwen2.5-Omni setting)
      and the count from its valid frames;
    - ``decode + WhisperFeatureExtractor``: ``load_audio`` + transformers' extractor (the count from
      its attention mask): what a pipeline without header counting pays.

    All three give the same counts (checked here on every file). Files per second, median of
    ``--repeats``.

(b) **log-mel extraction** of the decoded clips (16 kHz mono), padded to 30 s like the Qwen
    processors, in batches of ``--batch``: ``omniweave.data.media.mel.log_mel`` vs
    ``WhisperFeatureExtractor.__call__`` (its torch path) for 80 and 128 bins; clips per second,
    median of ``--repeats``, and the max |difference| of the features. Twice: the decoded clips
    (mostly padding, which ``log_mel`` does not transform) and the same audio tiled to exactly 30 s
    (no padding: the STFT and mel themselves compared).

(c) **audio towers**, forward + backward (gradients of every parameter) over the log-mel features
    of all decoded clips at once: our ``qwen2_audio`` and ``qwen2_5_omni`` towers (one varlen call
    over all items) vs transformers' ``Qwen2AudioEncoder`` (the clips' 30 s windows in one padded
    batch with the padding masked, as ``Qwen2AudioForConditionalGeneration`` calls it) and
    ``Qwen2_5OmniAudioEncoder`` (the clips concatenated with ``feature_lens``, as the thinker calls
    it), both on sdpa attention, with the same weights (``TOWER``: a small tower, real mel bins and
    windows); clips per second, median of ``--repeats``, and the max |difference| of the outputs.

Timings use ``--threads`` intra-op threads (both sides) and wall time; medians over ``--repeats``
after one warm-up pass.

    python bench/audio.py [--files 24] [--seconds 8] [--batch 8] [--repeats 5] [--threads 1]
                          [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 6 files of 1 s, batch 2, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo: omniweave and tests/audio_factory, also as a plain script
sys.path.insert(0, str(ROOT / "bench"))  # bench/quick.py
from figure import pyplot, save
from quick import HELP as QUICK_HELP
from quick import note

from omniweave.data.media import audio as A
from omniweave.data.media.mel import log_mel
from omniweave.models.hf.qwen2_audio import Qwen2AudioAdapter
from omniweave.models.registry import build_component
from tests.audio_factory import FORMATS, OPUS_RATES, available, encode, signal

RATES = (8000, 16000, 22050, 44100, 48000)
# (c)'s towers in transformers' config names: real mel bins and 30 s windows, small layers
TOWER = {"num_mel_bins": 128, "encoder_layers": 2, "d_model": 64, "encoder_attention_heads": 4,
         "encoder_ffn_dim": 256, "max_source_positions": 1500}
OMNI = {"n_window": 100, "output_dim": 512}  # the Qwen2.5-Omni tower's chunking and projection


def make_files(n: int, seconds: float) -> list[tuple[str, bytes]]:
    """``n`` files cycling through the formats, rates and channel counts the encoders support."""
    combos = [(fmt, rate, ch) for fmt in FORMATS if available(fmt) for rate in RATES for ch in (1, 2)
              if not (fmt == "opus" and rate not in OPUS_RATES) and not (fmt == "ogg" and ch == 1)]
    step = max(1, len(combos) // n)
    picked = [combos[(i * step + i // len(combos)) % len(combos)] for i in range(n)]
    return [(f"{fmt} {rate // 1000}k {'stereo' if ch == 2 else 'mono'}",
             encode(signal(seconds * (0.8 + 0.4 * i / max(1, n - 1)), rate, ch, seed=i), rate, fmt))
            for i, (fmt, rate, ch) in enumerate(picked)]


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after one warm-up; and its result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def counting_rows(files, args, extractor) -> list[dict]:
    datas = [d for _, d in files]

    def header():
        infos = [A.probe_audio(d) for d in datas]
        return [(A.audio_tokens(i, "qwen2_audio"), A.audio_tokens(i, "qwen2_5_omni")) for i in infos]

    def ours():
        out = []
        for d in datas:
            x = A.load_audio(d)
            chunks = np.split(x, np.cumsum(A.qwen2_audio_chunks(len(x)))[:-1])
            frames = log_mel([torch.from_numpy(c) for c in chunks], 128).num_frames
            omni = log_mel([torch.from_numpy(x)], 128, truncation=False).num_frames
            out.append((sum(A.encoder_tokens(int(f)) for f in frames), A.encoder_tokens(int(omni[0]))))
        return out

    def hf():
        out = []
        for d in datas:
            x = A.load_audio(d)
            chunks = np.split(x, np.cumsum(A.qwen2_audio_chunks(len(x)))[:-1])
            masks = extractor[128](chunks, sampling_rate=16000, return_attention_mask=True)["attention_mask"]
            omni = extractor[128](x, sampling_rate=16000, truncation=False, return_attention_mask=True)["attention_mask"]
            out.append((sum(A.encoder_tokens(int(m.sum())) for m in masks), A.encoder_tokens(int(omni.sum()))))
        return out

    rows, counts = [], {}
    for name, fn in (("header", header), ("decode + mel (ours)", ours), ("decode + WhisperFeatureExtractor", hf)):
        seconds, counts[name] = timed(fn, args.repeats)
        rows.append({"method": name, "s": seconds, "files_per_s": len(datas) / seconds})
        print(f"  {name:>34}: {len(datas) / seconds:9.1f} files/s", flush=True)
    assert counts["header"] == counts["decode + mel (ours)"] == counts["decode + WhisperFeatureExtractor"], counts
    return rows


def mel_rows(clips, args, extractor, label: str) -> list[dict]:
    rows = []
    batches = [clips[i:i + args.batch] for i in range(0, len(clips), args.batch)]
    for n_mels in (80, 128):
        fe = extractor[n_mels]
        s_ours, ours = timed(lambda n=n_mels: [log_mel([torch.from_numpy(c) for c in b], n).features for b in batches],
                             args.repeats)
        s_hf, ref = timed(lambda fe=fe: [fe(b, sampling_rate=16000, return_tensors="np")["input_features"]
                                         for b in batches], args.repeats)
        diff = max(float(np.abs(o.numpy() - r).max()) for o, r in zip(ours, ref))
        rows.append({"clips": label, "n_mels": n_mels, "ours_clips_per_s": len(clips) / s_ours,
                     "hf_clips_per_s": len(clips) / s_hf, "speedup": s_hf / s_ours, "max_abs_diff": diff})
        print(f"  {label}, {n_mels} bins: ours {len(clips) / s_ours:.1f} clips/s, WhisperFeatureExtractor "
              f"{len(clips) / s_hf:.1f} clips/s ({s_hf / s_ours:.2f}x), max |diff| {diff:.1e}", flush=True)
    return rows


def towers(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, transformers') ``family`` tower of ``TOWER`` sizes with the same random weights."""
    if family == "qwen2_audio":
        from transformers.models.qwen2_audio.configuration_qwen2_audio import Qwen2AudioEncoderConfig as HFConfig
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder as HFTower

        hf_cfg, extra = HFConfig(**TOWER), {}
    else:
        from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoderConfig as HFConfig,
        )
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder as HFTower

        hf_cfg, extra = HFConfig(**TOWER, **OMNI), {"name": family, **OMNI}
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = HFTower(hf_cfg)
    cfg = {**Qwen2AudioAdapter().encoder_config_to_ours(hf_cfg.to_dict()), **extra, "attn_backend": "sdpa"}
    ours = build_component("audio_encoder", cfg)
    ours.load_state_dict(hf.state_dict())  # the same parameter names (strict)
    return ours, hf


def encoder_rows(clips, args) -> list[dict]:
    from transformers.masking_utils import create_bidirectional_mask

    rows = []
    for family in ("qwen2_audio", "qwen2_5_omni"):
        ours, hf = towers(family)
        # Qwen2-Audio: one 30 s window per clip (all fit); Qwen2.5-Omni: whole clips
        mel = log_mel([torch.from_numpy(c) for c in clips], TOWER["num_mel_bins"], truncation=family == "qwen2_audio")
        features, frames = mel.features, mel.num_frames
        if family == "qwen2_audio":
            conv_len, out_len = hf._get_feat_extract_output_lengths(frames)
            positions = (features.shape[-1] - 2) // 2 + 1
            mask = create_bidirectional_mask(config=hf.config, inputs_embeds=torch.zeros(len(clips), positions, 1),
                                             attention_mask=(torch.arange(positions)[None] < conv_len[:, None]).long())
            keep = torch.arange(positions // 2)[None] < out_len[:, None]  # each clip's valid rows, as the model keeps

            def hf_forward():
                return hf(features, attention_mask=mask).last_hidden_state[keep]
        else:
            joint = torch.cat([features[i, :, :f] for i, f in enumerate(frames.tolist())], dim=1)

            def hf_forward():
                return hf(joint, feature_lens=frames).last_hidden_state

        def step(model, forward):
            out = forward()
            params = [p for p in model.parameters() if p.requires_grad]  # HF's position table is frozen
            torch.autograd.grad(out.square().mean(), params, allow_unused=True)  # HF's unused audio_bos_eos_token
            return out.detach()

        s_ours, out = timed(lambda: step(ours, lambda: ours(features, frames)), args.repeats)
        s_hf, ref = timed(lambda: step(hf, hf_forward), args.repeats)
        diff = float((out - ref).abs().max())
        rows.append({"tower": family, "clips": len(clips), "ours_clips_per_s": len(clips) / s_ours,
                     "hf_clips_per_s": len(clips) / s_hf, "speedup": s_hf / s_ours, "max_abs_diff": diff})
        print(f"  {family}: ours {len(clips) / s_ours:.1f} clips/s, transformers {len(clips) / s_hf:.1f} clips/s "
              f"({s_hf / s_ours:.2f}x), max |diff| {diff:.1e}", flush=True)
    return rows


def tables(args, count, mel, enc) -> str:
    lines = [(f"(a) token counting: {args.files} files (~{args.seconds:g} s each), {args.threads} thread(s), "
              f"median of {args.repeats}"), "", "| method | files/s | header's speedup |", "|---|---:|---:|"]
    base = count[0]["files_per_s"]
    lines += [f"| {r['method']} | {r['files_per_s']:.1f} | {base / r['files_per_s']:.1f}x |" for r in count]
    lines += ["", f"(b) log-mel, padded to 30 s, batches of {args.batch}, median of {args.repeats}", "",
              "| clips | bins | ours clips/s | WhisperFeatureExtractor clips/s | speedup | max abs diff |",
              "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['clips']} | {r['n_mels']} | {r['ours_clips_per_s']:.1f} | {r['hf_clips_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.1e} |" for r in mel]
    sizes = f"{TOWER['encoder_layers']} layers, width {TOWER['d_model']}, {TOWER['encoder_ffn_dim']} ffn"
    lines += ["", f"(c) audio towers ({sizes}), forward + backward over all {args.files} clips in one call, "
              f"median of {args.repeats}", "",
              "| tower | ours clips/s | transformers clips/s | speedup | max abs diff |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['tower']} | {r['ours_clips_per_s']:.1f} | {r['hf_clips_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.1e} |" for r in enc]
    return "\n".join(lines)


def plot(count, mel, enc, path: Path) -> None:
    import matplotlib.ticker

    plt = pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(17, 4))
    ax[0].barh([r["method"] for r in count], [r["files_per_s"] for r in count])
    ax[0].set(xscale="log", xlim=(1, None), xlabel="files/s (log)", title="audio token counting")
    ax[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    paired_bars(ax[1], mel, [f"{r['clips']}\n{r['n_mels']} bins" for r in mel], "log-mel extraction",
                ("omniweave log_mel", "WhisperFeatureExtractor"))
    paired_bars(ax[2], enc, [f"{r['tower']} ({r['speedup']:.1f}x)" for r in enc], "audio tower, forward + backward",
                ("omniweave (varlen)", "transformers"))
    save(fig, path, grid=ax)


def paired_bars(ax, rows: list[dict], ticks: list[str], title: str, labels: tuple[str, str]) -> None:
    """Ours (``ours_clips_per_s``) and the baseline (``hf_clips_per_s``) side by side, a pair per row."""
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["ours_clips_per_s"] for r in rows], 0.4, label=labels[0])
    ax.bar(x + 0.2, [r["hf_clips_per_s"] for r in rows], 0.4, label=labels[1])
    ax.set(xticks=x, xticklabels=ticks, ylabel="clips/s", title=title)
    ax.legend()


def main() -> int:
    from omniweave.models.hf.torchvision_guard import torchvision_loads

    torchvision_loads()  # where torchvision's ops do not load beside this torch, transformers is told it is absent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=24, help="audio files generated (formats, rates, channels cycled)")
    p.add_argument("--seconds", type=float, default=8.0, help="mean length of a file (0.8x to 1.2x)")
    p.add_argument("--batch", type=int, default=8, help="clips per log-mel call in (b)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 6 files of 1 s, batch 2")
    args = p.parse_args()
    if args.quick:
        args.files, args.seconds, args.batch, args.repeats = 6, 1.0, 2, 1
        note("6 files of 1 s, batch 2, 1 repeat")
    from transformers import WhisperFeatureExtractor
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = make_files(args.files, args.seconds)
    extractor = {n: WhisperFeatureExtractor(feature_size=n) for n in (80, 128)}
    print("(a) token counting", flush=True)
    count = counting_rows(files, args, extractor)
    print("(b) log-mel extraction", flush=True)
    clips = [A.load_audio(d) for _, d in files]
    mel = mel_rows(clips, args, extractor, f"~{args.seconds:g} s decoded")
    # the same audio tiled to exactly 30 s: no padding to skip, the STFT itself compared
    mel += mel_rows([np.resize(c, A.WINDOW_SAMPLES) for c in clips], args, extractor, "tiled to 30 s")
    print("(c) audio towers", flush=True)
    enc = encoder_rows(clips, args)
    table = tables(args, count, mel, enc)
    print(f"\n{table}\n\ntotal {time.perf_counter() - t0:.0f} s")
    (args.out / "audio.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "files": [n for n, _ in files], "count": count, "mel": mel,
                                                     "encoder": enc}, indent=1))
    plot(count, mel, enc, args.out / "audio.png")
    print(f"wrote {args.out / 'audio.png'} and {args.out / 'audio.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
