"""``data.mix``: several packed datasets sampled by weight, deterministic and exactly resumable.

    data:
      mix:
        - {path: runs/web/packed, weight: 0.7}
        - {path: runs/code/packed, weight: 0.3, name: code}

Each entry names a packed dataset (``path``) and its share: ``weight`` (any positive number; the
weights are normalised) or ``epochs`` (its packs per mix cycle = epochs × its pack count, i.e. a
weight of epochs × packs). All entries of a mix use the same one of the two. ``name`` (default: the
folder name, or as many of its last folders as tell the entries apart) names the dataset in errors
and metrics. ``data.path`` and ``data.mix`` exclude each other.

The stream. Every dataset gets an integer quota q_i of a cycle of L = Σ q_i stream positions:
``epochs`` entries q_i = round(epochs_i × packs_i); ``weight`` entries the weights in 2^20ths
(largest remainder). Position n of the endless stream takes dataset i when

    v_n = (s + n·a) mod L   falls in   [q_0 + … + q_{i-1}, q_0 + … + q_i)

with a the integer nearest L·(√5−1)/2 that is coprime to L (a golden-ratio Weyl sequence) and s a
seeded offset in [0, L). Because a is coprime to L, v takes every value of [0, L) once in any L
consecutive positions: every cycle holds exactly q_i packs of dataset i, and the golden step
spreads them evenly (a window of k positions holds k·q_i/L packs of dataset i to within about two
packs; measured: within 0.02 % over 10,000 packs for weights 0.5/0.3/0.2). Within dataset i the
packs follow its own endless epochs, epoch e the permutation ``default_rng([seed, MIX_TAG, i, e])``
of its packs, so a small dataset repeats while a large one is still in its first epoch. (Seeded
draws per block would do the proportions too, but this interleave needs no replay to resume: see
the state below.)

The state is one number, the stream position n (kept as the loader's (epoch, cursor) = (n // L,
n % L)): how many packs of each dataset come before n is a count of an arithmetic progression
modulo L below a bound, a floor sum computed exactly in O(log L) (:func:`floor_sum`), so any
position (a resume, another dp_size, a DataLoader worker running ahead) is reached without
replaying the stream, and dataset i's own (epoch, cursor) follows from its count.

Metrics (``omniweave train``): per dataset, ``mix_packs.<name>`` and ``mix_samples.<name>``, the
packs and samples (documents; preference pairs for DPO) consumed so far by the whole run
(:class:`MixCounts`, kept in the checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import gcd
from pathlib import Path

import numpy as np

from omniweave.data.loading.loader import SKIPS_KEY, SOURCE_KEY, check_kind, collate_pack, open_packed
from omniweave.data.packing.packed import MANIFEST, PackedDataset
from omniweave.errors import UserError

WEIGHT_RESOLUTION = 2**20  # weights become integer quotas of a cycle of this many positions
MIX_TAG = 0x6D6978  # "mix": the mix's seeds never meet a single dataset's default_rng([seed, e])


@dataclass(frozen=True)
class MixEntry:
    name: str
    path: str
    weight: float | None = None
    epochs: float | None = None


def _plain_list(mix) -> list:
    if hasattr(mix, "_metadata"):  # a ListConfig
        from omegaconf import OmegaConf

        return OmegaConf.to_container(mix, resolve=True)
    return list(mix)


def _positive(value, what: str, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if isinstance(value, bool) or not math.isfinite(x) or x <= 0:
        raise UserError(f"data.mix {where}: {what}={value!r} must be a number > 0")
    return x


def _parts(path: str) -> tuple[str, ...]:
    return Path(path).parts or Path(path).resolve().parts


def _default_name(path: str, others: list[str]) -> str:
    """The folder's name, or as many of its last folders as tell it apart from ``others``
    (``web/packed`` beside ``code/packed``)."""
    parts = _parts(path)
    for k in range(1, len(parts) + 1):
        if all(_parts(o)[-k:] != parts[-k:] for o in others):
            break
    return "/".join(parts[-k:]).lstrip("/") or path


def parse_mix(mix) -> list[MixEntry]:
    """``data.mix`` as checked entries; a UserError naming the entry for anything wrong."""
    items = _plain_list(mix) if mix is not None else []
    if not items:
        raise UserError("data.mix is empty: list the packed datasets to mix, each {path: P, weight: W} or "
                        "{path: P, epochs: E} (docs/training.md, Mixing datasets)")
    entries = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise UserError(f"data.mix entry {i} is {item!r}: each entry is {{path: P, weight: W}} or "
                            "{path: P, epochs: E}")
        unknown = sorted(set(item) - {"path", "weight", "epochs", "name"})
        if unknown:
            raise UserError(f"data.mix entry {i}: unknown key(s) {', '.join(unknown)}; an entry has path, weight or "
                            "epochs, and optionally name")
        path = item.get("path")
        if path in (None, "", "???"):
            raise UserError(f"data.mix entry {i} has no path: each entry names a packed dataset (path: P)")
        unnamed = [str(o["path"]) for o in items if o is not item and isinstance(o, dict) and not o.get("name")
                   and o.get("path") not in (None, "", "???")]
        name = item.get("name") or _default_name(str(path), unnamed)
        where = f"entry {i} ({name!r})"
        weight, epochs = item.get("weight"), item.get("epochs")
        if (weight is None) == (epochs is None):
            raise UserError(f"data.mix {where}: give it a weight (weight: W) or epochs (epochs: E)"
                            + (", not both" if weight is not None else ""))
        entries.append(MixEntry(str(name), str(path),
                                weight=None if weight is None else _positive(weight, "weight", where),
                                epochs=None if epochs is None else _positive(epochs, "epochs", where)))
    by_weight = [e.name for e in entries if e.weight is not None]
    by_epochs = [e.name for e in entries if e.epochs is not None]
    if by_weight and by_epochs:
        raise UserError(f"data.mix mixes weight entries ({', '.join(by_weight)}) with epochs entries "
                        f"({', '.join(by_epochs)}): use one kind for every entry (epochs E of a dataset of N packs "
                        "is weight E x N)")
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise UserError(f"data.mix: two entries are named {e.name!r} ({seen[e.name]} and {e.path}); give them "
                            "distinct names (name: N)")
        seen[e.name] = e.path
    return entries


def data_source(data) -> tuple[str | None, list[MixEntry] | None]:
    """(``data.path``, None) or (None, ``data.mix``'s entries): a UserError unless exactly one is set."""
    from omniweave.config import RecipeError, unset_key_message

    get = data.get if hasattr(data, "get") else (lambda k, d=None: getattr(data, k, d))
    if hasattr(data, "_metadata"):
        from omegaconf import OmegaConf

        path = OmegaConf.select(data, "path", throw_on_missing=False, default=None)
    else:
        path = get("path")
    path = None if path in (None, "", "???") else str(path)
    mix = get("mix")
    if path is not None and mix is not None:
        raise UserError(f"data.path={path} and data.mix are both set: a run reads one packed dataset (data.path) or a "
                        "mix of several (data.mix); drop one (data.path=null unsets a recipe's path)")
    if mix is not None:
        return None, parse_mix(mix)
    if path is None:
        raise RecipeError(unset_key_message("data.path") + " (or data.mix: several packed datasets by weight)")
    return path, None


def check_mix_ready(entries: list[MixEntry], kind: str) -> None:
    """Before any rank starts: every dataset of the mix is there and holds what this run trains on."""
    import json

    for e in entries:
        manifest = Path(e.path) / MANIFEST
        if not manifest.is_file():
            raise UserError(f"data.mix entry {e.name!r}: path={e.path}: no packed dataset there (no {MANIFEST}); build "
                            f"it with `omniweave data pack --input RAW --output {e.path} --recipe RECIPE`")
        check_kind(json.loads(manifest.read_text()), kind, e.path, key=f"data.mix entry {e.name!r}: path")


# ---------------------------------------------------------------------------- the interleave


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """Σ_{k<n} floor((a·k + b) / m) for n, a, b >= 0, m >= 1, exactly, in O(log m) (AtCoder Library)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def golden_step(period: int) -> int:
    """The integer nearest period·(√5−1)/2 that is coprime to ``period`` (nearest first, the
    smaller on a tie)."""
    if period <= 2:
        return 1
    base = round(period * (math.sqrt(5) - 1) / 2)
    for d in range(period):
        for a in (base - d, base + d):
            if 0 < a < period and gcd(a, period) == 1:
                return a
    raise AssertionError(period)  # 1 is always coprime


def quotas(entries: list[MixEntry], sizes: list[int]) -> list[int]:
    """Each dataset's stream positions per mix cycle."""
    if entries[0].epochs is not None:
        out = [int(round(e.epochs * n)) for e, n in zip(entries, sizes)]
        for e, n, q in zip(entries, sizes, out):
            if q < 1:
                raise UserError(f"data.mix entry {e.name!r}: epochs={e.epochs} of its {n} packs is less than one pack "
                                "per mix cycle; raise it")
        return out
    total = sum(e.weight for e in entries)
    exact = [e.weight / total * WEIGHT_RESOLUTION for e in entries]
    out = [int(math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(out)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[: WEIGHT_RESOLUTION - sum(out)]:
        out[i] += 1
    for e, q in zip(entries, out):
        if q < 1:
            raise UserError(f"data.mix entry {e.name!r}: weight={e.weight} is less than 1/{WEIGHT_RESOLUTION} of the "
                            "total; raise it or leave the dataset out")
    return out


class PackMix:
    """The loader's source for ``data.mix`` (``loader.PackedLoader(mix=...)``): a reference is a
    global pack id, dataset i's packs at ``offsets[i] : offsets[i] + sizes[i]``."""

    def __init__(self, entries: list[MixEntry], seed: int, data_cfg=None, kind: str = "sft"):
        self.entries, self.seed = list(entries), seed
        self.names = [e.name for e in self.entries]
        self.datasets = [open_packed(e.path, data_cfg, kind, key=f"data.mix entry {e.name!r}: path",
                                     where=f"{e.path} (data.mix entry {e.name!r})") for e in self.entries]
        self.sizes = [len(ds) for ds in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_packs = int(self.offsets[-1])
        self.quotas = quotas(self.entries, self.sizes)
        self.bounds = np.concatenate([[0], np.cumsum(self.quotas)]).astype(np.int64)
        self.period = int(self.bounds[-1])  # L: the mix cycle
        self.step = golden_step(self.period)
        self.offset = int(np.random.default_rng([seed, MIX_TAG]).integers(self.period))
        self.data_cfg = self.datasets[0].manifest["data_cfg"]
        self._orders: list[dict[int, np.ndarray]] = [{} for _ in self.entries]

    # ------------------------------------------------------------------ positions

    def choices(self, n: int, count: int) -> np.ndarray:
        """The dataset of stream positions n .. n+count-1, int64 [count]."""
        v0 = (self.offset + n * self.step) % self.period
        v = (v0 + self.step * np.arange(count, dtype=np.int64)) % self.period
        return np.searchsorted(self.bounds[1:-1], v, side="right")

    def _below(self, n: int, bound: int) -> int:
        """#{k < n : (s + k·a) mod L < bound}, exactly (0 <= bound <= L)."""
        L, a, s = self.period, self.step, self.offset
        if bound <= 0:
            return 0
        if bound >= L:
            return n
        # (x mod L) >= bound  <=>  floor((x + L - bound) / L) - floor(x / L) = 1
        return n - (floor_sum(n, L, a, s + L - bound) - floor_sum(n, L, a, s))

    def consumed(self, n: int) -> list[int]:
        """Packs of each dataset among the first n stream positions."""
        below = [self._below(n, int(b)) for b in self.bounds]
        return [below[i + 1] - below[i] for i in range(len(self.entries))]

    def dataset_order(self, i: int, epoch: int) -> np.ndarray:
        """Dataset i's epoch ``epoch``: a seeded permutation of its pack ids."""
        cache = self._orders[i]
        if epoch not in cache:
            if len(cache) >= 2:  # a batch straddles at most a few epochs; keep the newest
                cache.pop(next(iter(cache)))
            cache[epoch] = np.random.default_rng([self.seed, MIX_TAG, i, epoch]).permutation(self.sizes[i])
        return cache[epoch]

    def refs(self, n: int, count: int) -> list[int]:
        """The global pack ids of stream positions n .. n+count-1."""
        which = self.choices(n, count)
        out = np.empty(count, np.int64)
        for i in np.unique(which).tolist():
            at = np.flatnonzero(which == i)
            epochs, cursors = np.divmod(self._below_dataset(n, i) + np.arange(len(at)), self.sizes[i])
            local = np.empty(len(at), np.int64)
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                local[sel] = self.dataset_order(i, int(e))[cursors[sel]]
            out[at] = self.offsets[i] + local
        return out.tolist()

    def _below_dataset(self, n: int, i: int) -> int:
        return self._below(n, int(self.bounds[i + 1])) - self._below(n, int(self.bounds[i]))

    def batch(self, epoch: int, cursor: int, count: int) -> tuple[list[int], int, int]:
        """The references of ``count`` positions from (epoch, cursor) = (cycle, position in it), and the state after."""
        n = self.position(epoch, cursor)
        return self.refs(n, count), (n + count) // self.period, (n + count) % self.period

    def position(self, epoch: int, cursor: int) -> int:
        return epoch * self.period + cursor

    # ------------------------------------------------------------------ packs

    def locate(self, ref: int) -> tuple[int, int]:
        """(dataset, its pack id) of a global pack id."""
        i = int(np.searchsorted(self.offsets, ref, side="right")) - 1
        return i, int(ref - self.offsets[i])

    def record(self, ref: int) -> dict:
        i, local = self.locate(ref)
        return self.datasets[i].record(local)

    def pack_map(self, share: bool = True):
        m = _MixMap(self)
        if share:
            m._ds = self.datasets
        return m

    # ------------------------------------------------------------------ state and words

    def state(self, epoch: int, cursor: int) -> dict:
        consumed = self.consumed(self.position(epoch, cursor))
        return {"mix": [{"name": e.name, "packs": n, "quota": q, "consumed": c}
                        for e, n, q, c in zip(self.entries, self.sizes, self.quotas, consumed)]}

    def check_state(self, state: dict) -> None:
        saved = state.get("mix")
        if saved is None:
            raise UserError("the checkpoint's loader state is of one packed dataset (data.path); this run reads "
                            "data.mix: resume with the data the run was trained on")
        if len(saved) != len(self.entries):
            raise UserError(f"the checkpoint's loader state is of a mix of {len(saved)} datasets, data.mix lists "
                            f"{len(self.entries)}: resume with the mix the run was trained on")
        for e, n, q, s in zip(self.entries, self.sizes, self.quotas, saved):
            if (s["packs"], s["quota"]) != (n, q):
                raise UserError(f"data.mix entry {e.name!r}: the checkpoint's loader state is for {s['packs']} "
                                f"packs ({s['quota']} per mix cycle), {e.path} has {n} ({q}): resume with the data "
                                "and mix the run was trained on")

    def describe(self, global_batch: int) -> str:
        shares = ", ".join(f"{e.name} {q / self.period:.1%} ({n} packs)" for e, n, q in zip(self.entries, self.sizes,
                                                                                          self.quotas))
        cycle = f", a cycle of {self.period} packs = {max(1, self.period // global_batch)} steps" \
            if self.entries[0].epochs is not None else ""
        return f"mix of {len(self.entries)} datasets ({self.num_packs} packs): {shares}{cycle}"


class _MixMap:
    """What DataLoader workers index: a global pack id -> the collated micro-batch of its dataset,
    tagged with the dataset (``SOURCE_KEY``); a media skip names the dataset with its shard."""

    def __init__(self, mix: PackMix):
        self.paths = [e.path for e in mix.entries]
        self.names = list(mix.names)
        self.data_cfgs = [ds.manifest["data_cfg"] for ds in mix.datasets]
        self.offsets = mix.offsets
        self._ds = None

    def __getitem__(self, ref: int) -> dict:
        if self._ds is None:
            self._ds = [PackedDataset(p) for p in self.paths]
        i = int(np.searchsorted(self.offsets, ref, side="right")) - 1
        skips: list[dict] = []
        mb = collate_pack(self._ds[i][int(ref - self.offsets[i])], self.data_cfgs[i], skips)
        for s in skips:
            s["shard"] = f"{self.names[i]}/{s['shard']}"
        return {**mb, SKIPS_KEY: skips, SOURCE_KEY: i}

    def __len__(self) -> int:
        return int(self.offsets[-1])


# ---------------------------------------------------------------------------- metrics


def batch_counts(num_datasets: int, sources: list[int], batch: list[dict]) -> list[int]:
    """This rank's [packs of dataset 0, samples of dataset 0, packs of 1, …] in one batch: a sample is a
    document of a pack, a preference pair for DPO."""
    out = [0] * (2 * num_datasets)
    for i, mb in zip(sources, batch):
        out[2 * i] += 1
        out[2 * i + 1] += int(mb["num_pairs"]) if "num_pairs" in mb else len(mb["cu_seqlens"]) - 1
    return out


class MixCounts:
    """The run's packs and samples per dataset so far (every rank's, summed by the trainer)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.packs, self.samples = [0] * len(names), [0] * len(names)

    def add(self, summed: list[float]) -> dict:
        """Add one step's summed ``batch_counts``; the metrics of the run so far."""
        for i in range(len(self.names)):
            self.packs[i] += int(round(summed[2 * i]))
            self.samples[i] += int(round(summed[2 * i + 1]))
        return {**{f"mix_packs.{n}": p for n, p in zip(self.names, self.packs)},
                **{f"mix_samples.{n}": s for n, s in zip(self.names, self.samples)}}

    def state_dict(self) -> dict:
        return {"packs": list(self.packs), "samples": list(self.samples)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.packs, self.samples = [int(x) for x in state["packs"]], [int(x) for x in state["samples"]]
