"""Run a function on N ranks in fresh processes: the multi-process tests and ``omniweave check``.

    def body(rank, world, x):          # module-level (picklable); runs in every rank
        device = rank_device()         # cpu under gloo, cuda:<rank> under nccl
        ...                            # the default process group is initialised
        return result                  # must be picklable (tensors are copied back)

    results = run_ranks(body, 2, x)                  # gloo on CPU: [result of rank 0, of rank 1]
    results = run_ranks(body, 4, x, device="cuda")   # nccl, rank r on cuda:r

Each rank uses one intra-op thread (several ranks share 2 cores in CI). A failing rank raises
here with its traceback; a hang is cut off after ``timeout`` seconds. ``quiet=True`` sends the
ranks' own output (library warnings, logs) to a file each, shown only when the run fails.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
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


def _log_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.log")


def _output_tails(tmp: str, world: int, chars: int = 3000) -> str:
    tails = []
    for rank in range(world):
        path = _log_path(tmp, rank)
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            text = f.read()[-chars:].strip()
        if text:
            tails.append(f"--- rank {rank} output (end) ---\n{text}")
    return "\n".join(tails)


def _entry(rank: int, world: int, info: DeviceInfo, tmp: str, quiet: bool, queue, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if quiet:  # file descriptors, so that C++ and NCCL output goes there too
        log = os.open(_log_path(tmp, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    try:
        if info.module is not None:  # before the process group: NCCL binds to the current device
            info.module.set_device(rank)
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group(info.backend, store=store, rank=rank, world_size=world)
        try:
            # plain pickle: tensors travel by value (the queue's default shares their storage
            # with this process, which is gone by the time the parent reads them)
            queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def _next_report(queue, procs: list, reported: dict, timeout: float) -> tuple[int, bool, object]:
    """The next (rank, ok, value) from the ranks. A rank that died without reporting (killed,
    crashed in C++, broken start) fails at once rather than after ``timeout`` seconds of waiting."""
    waited = 0.0
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            waited += 1.0
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
        if dead:
            try:  # its report may still be in the pipe
                return queue.get(timeout=1.0)
            except queue_module.Empty:
                return dead[0], False, f"exited with code {procs[dead[0]].exitcode} without reporting"
        if waited >= timeout:
            raise queue_module.Empty


def run_ranks(fn, world: int, *args, timeout: float = 180.0, device: str = "cpu", quiet: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` ranks of ``device``'s backend (cpu: gloo, cuda:
    nccl with rank r on device r); returns the results in rank order."""
    info = detect(device)
    if info.module is not None and world > info.module.device_count():
        raise ValueError(f"{world} ranks on {device}: only {info.module.device_count()} device(s)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world, info, tmp, quiet, queue, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: list[str] = []
        try:
            for _ in range(world):
                rank, ok, value = _next_report(queue, procs, results, timeout)
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        except queue_module.Empty as e:  # a rank hung
            errors.append(f"ranks did not finish within {timeout:.0f} s ({type(e).__name__}); "
                          f"finished: {sorted(results)}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors and quiet:
            errors.append(_output_tails(tmp, world))
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
