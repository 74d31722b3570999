"""Run a function on N gloo ranks in fresh processes (for multi-process unit tests).

    def body(rank, world, x):          # module-level (picklable); runs in every rank
        ...                            # the default process group is initialised (gloo, CPU)
        return result                  # must be picklable (tensors are copied back)

    results = run_ranks(body, 2, x)    # [result of rank 0, result of rank 1]

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


def _entry(rank: int, world: int, store_path: str, queue, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            # plain pickle: tensors travel by value (the queue's default shares their storage
            # with this process, which is gone by the time the parent reads them)
            queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 180.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), queue, fn, args))
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
