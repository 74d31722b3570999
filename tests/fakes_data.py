"""A small raw-shard dataset in the contract format (via omniweave.data.sources.shards) for the pack tests:
text-only, image and video samples plus a few that the tokenizer rejects."""

from __future__ import annotations

from pathlib import Path

from omniweave.data.sample import Conversation, Message
from omniweave.data.sources.shards import ShardWriter, finalize_shard, sample_key, shard_name, write_metadata
from tests.data_factory import png_bytes, video_bytes

RECIPE = Path(__file__).with_name("pack_recipe.yaml")  # data: max_len 512, small vision limits
DATA_CFG = {
    "tokenizer": "demo", "template": "chatml", "max_len": 512, "truncation": "drop", "rope": "mrope",
    "vision": {"min_pixels": 3136, "max_pixels": 12544, "video_min_pixels": 3136, "video_max_pixels": 12544},
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _text(i: int, n_words: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


def make_samples(n_text: int = 24, n_image: int = 10, n_video: int = 4, rejects: bool = True):
    """[(Conversation, media parts)] in dataset order; sizes vary so packs mix documents."""
    out = []
    for i in range(n_text):
        msgs = [Message("user", f"question {i}: {_text(i, 3 + i % 7)}"),
                Message("assistant", _text(i + 1, 2 + (i * 5) % 23))]
        if i % 5 == 0:  # multi-turn
            msgs += [Message("user", "and then?"), Message("assistant", _text(i + 2, 4))]
        out.append((Conversation(f"text-{i}", msgs), {}))
    for i in range(n_image):
        n = 1 + i % 2
        media = {f"img{k}.png": png_bytes(56, 56 + 28 * ((i + k) % 3), seed=i * 7 + k) for k in range(n)}
        msgs = [Message("user", "<image>" * n + f"describe {i}"), Message("assistant", _text(i, 3 + i % 9))]
        out.append((Conversation(f"image-{i}", msgs, images=list(media)), media))
    for i in range(n_video):
        media = {"vid0.mp4": video_bytes(8, fps=4.0, height=56, width=56, seed=i)}
        msgs = [Message("user", f"<video>what moves {i}?"), Message("assistant", _text(i, 5))]
        out.append((Conversation(f"video-{i}", msgs, videos=["vid0.mp4"]), media))
    if rejects:
        out.append((Conversation("no-answer", [Message("user", "hello")]), {}))
        out.append((Conversation("too-long", [Message("user", "long"), Message("assistant", _text(0, 900))]), {}))
    # interleave modalities deterministically so shards mix them
    return [out[j] for j in sorted(range(len(out)), key=lambda j: (j * 7919) % len(out))]


def write_raw(root: str | Path, samples, per_shard: int = 10) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for s in range(0, len(samples), per_shard):
        writer = ShardWriter(root / f"{shard_name(len(records))}.tmp")
        for g in range(s, min(s + per_shard, len(samples))):
            conv, media = samples[g]
            parts = {"json": __import__("json").dumps(conv.to_json()).encode()}
            parts.update(media)
            writer.write(sample_key(g), parts)
        records.append(finalize_shard(writer, root / shard_name(len(records))))
    write_metadata(root, records)
    return root


def pack_cli(raw, out, *extra: str) -> int:
    """``omniweave data pack`` in-process with the test recipe (one worker process)."""
    from omniweave.cli import main

    return main(["data", "pack", "--input", str(raw), "--output", str(out), "--recipe", str(RECIPE),
                 "--workers", "1", "--packs-per-shard", "3", *extra])


def build_packed(tmp: Path, *extra: str, samples=None) -> tuple[Path, Path]:
    raw = write_raw(Path(tmp) / "raw", samples if samples is not None else make_samples())
    out = Path(tmp) / "packed"
    assert pack_cli(raw, out, *extra) == 0
    return raw, out
