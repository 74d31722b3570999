"""Run a function on N ranks in fresh processes: the multi-process tests and ``omniweave check``.

    def body(rank, world, x):          # module-level (picklable); runs in every rank
        device = rank_device()         # cpu under gloo, cuda:<rank> under nccl
        ...                            # the default process group is initialised
        return result                  # must be picklable (tensors are copied back)

    results = run_ranks(body, 2, x)                  # gloo on CPU: [result of rank 0, of rank 1]
    results = run_ranks(body, 4, x, device="cuda")   # nccl, rank r on cuda:r

Each rank uses one intra-op thread (several ranks share 2 cores in CI). A failing rank raises
here with its traceback; a hang is cut off after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omniweave.device import DeviceInfo, detect


def rank_device() -> torch.device:
    """This rank's device inside ``run_ranks``: the accelerator it was pinned to, else the CPU."""
    if dist.is_initialized() and dist.get_backend() != "gloo":  # _entry pinned the rank to its device
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _entry(rank: int, world: int, info: DeviceInfo, store_path: str, queue, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if info.module is not None:  # before the process group: NCCL binds to the current device
            info.module.set_device(rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(info.backend, store=store, rank=rank, world_size=world)
        try:
            # plain pickle: tensors travel by value (the queue's default shares their storage
            # with this process, which is gone by the time the parent reads them)
            queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 180.0, device: str = "cpu") -> list:
    """``fn(rank, world, *args)`` on ``world`` ranks of ``device``'s backend (cpu: gloo, cuda:
    nccl with rank r on device r); returns the results in rank order."""
    info = detect(device)
    if info.module is not None and world > info.module.device_count():
        raise ValueError(f"{world} ranks on {device}: only {info.module.device_count()} device(s)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world, info, os.path.join(tmp, "store"), queue, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: list[str] = []
        try:
            for _ in range(world):
                rank, ok, value = queue.get(timeout=timeout)
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        except Exception as e:  # noqa: BLE001 - queue.Empty: a rank hung
            errors.append(f"ranks did not finish within {timeout:.0f} s ({type(e).__name__}); "
                          f"finished: {sorted(results)}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
