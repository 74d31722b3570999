"""``omniweave check`` rows for the attention kernels: every backend this machine has against the
``math`` reference (fp32, same device), forward (out and lse) and backward (dq, dk, dv).

The reference runs on the backend's inputs rounded to the checked dtype and cast back to fp32, so
a row measures the kernel's own error, not the rounding of its inputs. Each row's error is the
worst of ``rel_err`` (max |Δ| / max |ref|) over out, lse, dq, dk, dv.
"""

from __future__ import annotations

from typing import Iterator

import torch

from omniweave.check import Row, rel_err, verdict
from omniweave.models.components.attention import BACKENDS, math_attn, resolve

LIMITS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # fp32: kernel noise; bf16: a few output roundings
HEAD_DIM = 64
# (name, query heads, kv heads, causal, window): MHA and GQA, causal (decoder) and bidirectional
# windowed (Qwen2.5-VL's window attention)
CASES = [("causal", 4, 4, True, None), ("causal gqa 4:2", 4, 2, True, None),
         ("causal gqa 6:2 window 7", 6, 2, True, 7), ("bidirectional window 5", 4, 4, False, 5)]  # fmt: skip


def doc_lengths(quick: bool) -> list[int]:
    """Documents of one token beside short and long ones (the long one crosses kernel tiles)."""
    return [1, 37, 1, 300, 5, 1] if quick else [1, 129, 1, 2048, 17, 1, 700]


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(lens, heads, kv_heads, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v, dout = (torch.randn(t, h, HEAD_DIM, generator=g) for h in (heads, kv_heads, kv_heads, heads))
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def _fwd_bwd(fn, q, k, v, dout, cu, causal, window):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, cu, cu, causal, window)
    (out.float() * dout.float()).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def compare(backend: str, dtype, lens, heads, kv_heads, causal, window, device) -> float:
    """Worst relative error of ``backend`` vs math over out, lse, dq, dk, dv."""
    q, k, v, dout = _inputs(lens, heads, kv_heads, dtype, device)
    cu = _cu(lens, device)
    got = _fwd_bwd(BACKENDS[backend].attn, q, k, v, dout, cu, causal, window)
    ref = _fwd_bwd(math_attn, *(x.float() for x in (q, k, v, dout)), cu, causal, window)
    return max(rel_err(a, b) for a, b in zip(got, ref))


def _serving(name: str, dtype, device) -> str | None:
    """Why ``name`` would not serve a call of this dtype here (None: it would)."""
    probe = torch.zeros(1, 1, HEAD_DIM, dtype=dtype, device=device)
    served = resolve(name, probe, probe).name
    return None if served == name else f"{dtype} calls fall back to {served}"


def backend_rows(device, quick: bool) -> Iterator[Row]:
    lens = doc_lengths(quick)
    for name, backend in BACKENDS.items():
        if name == "math":
            continue
        missing = backend.missing()
        if missing:
            yield Row("kernels", f"{name}", "skip", note=missing)
            continue
        for dtype in LIMITS:
            dt = str(dtype).removeprefix("torch.")
            why = _serving(name, dtype, device)
            if why:
                yield Row("kernels", f"{name} {dt}", "skip", note=why)
                continue
            for label, h, hkv, causal, window in CASES:
                err = compare(name, dtype, lens, h, hkv, causal, window, device)
                yield verdict("kernels", f"{name} {dt} {label} fwd+bwd", err, LIMITS[dtype], f"docs {lens}")


def block_rows(device, quick: bool) -> Iterator[Row]:
    """Ring attention's block kernels: the second half of each document's queries over the first
    half of its keys (a full block) and over its own half (a causal diagonal block), merged, and
    both blocks' backward from the merged out / lse, against autograd through math."""
    from omniweave.parallel.context.kernels import merge_partials

    lens = [2 * n for n in ([3, 64, 1] if quick else [3, 512, 1, 100])]
    seen = set()
    for dtype in LIMITS:
        q0 = torch.zeros(1, 1, HEAD_DIM, dtype=dtype, device=device)
        backend = resolve("auto", q0, q0, block=True)
        if (backend.name, dtype) in seen:
            continue
        seen.add((backend.name, dtype))
        err = _block_error(backend.block, dtype, lens, device, merge_partials)
        dt = str(dtype).removeprefix("torch.")
        yield verdict("kernels", f"ring blocks {backend.name} {dt} fwd+bwd", err, LIMITS[dtype], "2 blocks merged")


def _block_error(block, dtype, lens, device, merge) -> float:
    q, k, v, dout = _inputs(lens, 4, 2, dtype, device, seed=1)
    half = [n // 2 for n in lens]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()[:-1]])
    first = torch.cat([torch.arange(s, s + h) for s, h in zip(starts.tolist(), half)]).to(device)
    second = torch.cat([torch.arange(s + h, s + 2 * h) for s, h in zip(starts.tolist(), half)]).to(device)
    cu_h, cu_full = _cu(half, device), _cu(lens, device)
    qs, dq_out = q[second], dout[second]
    mh, scale = max(half), HEAD_DIM**-0.5
    out_a, lse_a = block.forward(qs, k[first], v[first], cu_h, cu_h, mh, mh, False, scale)
    out_b, lse_b = block.forward(qs, k[second], v[second], cu_h, cu_h, mh, mh, True, scale)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    out = out.to(dtype)
    dq_a, dk_a, dv_a = block.backward(dq_out, qs, k[first], v[first], out, lse, cu_h, cu_h, mh, mh, False, scale)
    dq_b, dk_b, dv_b = block.backward(dq_out, qs, k[second], v[second], out, lse, cu_h, cu_h, mh, mh, True, scale)
    dk, dv = torch.zeros(k.shape, device=device), torch.zeros(v.shape, device=device)
    dk[first], dk[second], dv[first], dv[second] = dk_a.float(), dk_b.float(), dv_a.float(), dv_b.float()
    got = (out, lse, dq_a.float() + dq_b.float(), dk, dv)
    # reference: the second-half queries over their whole document (bottom-right causal)
    qr, kr, vr = (x.float().detach().requires_grad_() for x in (qs, k, v))
    ref_out, ref_lse = math_attn(qr, kr, vr, cu_h, cu_full, True)
    (ref_out * dq_out.float()).sum().backward()
    ref = (ref_out.detach(), ref_lse.detach(), qr.grad, kr.grad, vr.grad)
    return max(rel_err(a, b) for a, b in zip(got, ref))


def decode_rows(device, quick: bool) -> Iterator[Row]:
    """KV-cache decoding (one query per sequence over its cache slot) against math on the keys
    copied out, for each distinct decode kernel this device serves."""
    g = torch.Generator().manual_seed(2)
    slots_n, slot = (6, 40) if quick else (32, 512)
    slots = torch.tensor([0, 2, 3, 5], device=device)
    lengths = torch.tensor([1, slot, 17, slot // 2], device=device)
    seen = set()
    for dtype in LIMITS:
        k_cache, v_cache = (torch.randn(slots_n, slot, 2, HEAD_DIM, generator=g).to(device, dtype) for _ in "kv")
        q = torch.randn(len(slots), 4, HEAD_DIM, generator=g).to(device, dtype)
        backend = resolve("auto", q, k_cache)
        if (backend.decode, dtype) in seen:
            continue
        seen.add((backend.decode, dtype))
        out, lse = backend.decode(q, k_cache, v_cache, slots, lengths)
        k = torch.cat([k_cache[s, :n] for s, n in zip(slots.tolist(), lengths.tolist())]).float()
        v = torch.cat([v_cache[s, :n] for s, n in zip(slots.tolist(), lengths.tolist())]).float()
        cu_q = torch.arange(len(slots) + 1, dtype=torch.int32, device=device)
        ref_out, ref_lse = math_attn(q.float(), k, v, cu_q, _cu(lengths.tolist(), device), False)
        err = max(rel_err(out, ref_out), rel_err(lse, ref_lse))
        dt = str(dtype).removeprefix("torch.")
        yield verdict("kernels", f"decode {backend.name} {dt} (cache slots)", err, LIMITS[dtype],
                      f"lengths {lengths.tolist()}")


def rows(device: torch.device, quick: bool) -> Iterator[Row]:
    yield from backend_rows(device, quick)
    yield from block_rows(device, quick)
    yield from decode_rows(device, quick)
