"""The triton LogprobKernel at the issue shapes (up to N=20000, V=152064) on a CUDA GPU against a
chunked float64 reference computed on the GPU (analytic gradients:
dz = g_lp (onehot - p) - g_ent p (z - E_p[z]), divided by T), both tile modes.

Pass criteria per case: log-prob |err| <= 1e-3 + 2e-4 |ref|, entropy |err| <= 5e-3 + 5e-4 |ref|
elementwise; gradients: normwise relative error <= 2^-8 (bf16/fp16 rounding) or 1e-5 (fp32); ignored
rows exactly 0. Run on the GPU host: ``bash scripts/test_gpu.sh tests/gpu/test_logprob_cuda.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from underlay import registry
from underlay.backends.cuda import _logprob_triton as impl
from underlay.backends.cuda.logprob import TritonLogprobKernel
from underlay.interfaces import IGNORE_INDEX

pytestmark = pytest.mark.gpu

SHAPES = [
    (1937, 3584, 152064),
    (2169, 896, 151936),
    (1530, 2048, 32256),
    (1388, 4096, 102400),
    (8192, 4096, 102400),
]


def reference(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, t: float, g_lp: torch.Tensor, g_ent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-probs, entropy, grad_hidden, grad_weight (row chunks of at most 1 GiB of logits)."""
    h64, w64 = h.double(), w.double()
    n, v = h.shape[0], w.shape[0]
    rows = max(1, (1 << 27) // v)
    lp = torch.zeros(n, dtype=torch.float64, device=h.device)
    ent = torch.zeros_like(lp)
    gh = torch.zeros_like(h64)
    gw = torch.zeros_like(w64)
    valid = y != IGNORE_INDEX
    for r0 in range(0, n, rows):
        sl = slice(r0, min(n, r0 + rows))
        z = h64[sl] @ w64.T / t
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        yy = y[sl].clamp(min=0)
        ok = valid[sl]
        lp[sl] = torch.where(ok, logp.gather(1, yy[:, None])[:, 0], 0.0)
        ez = (p * z).sum(-1)
        ent[sl] = torch.where(ok, torch.logsumexp(z, -1) - ez, 0.0)
        a = torch.where(ok, g_lp[sl].double(), 0.0)[:, None]
        b = torch.where(ok, g_ent[sl].double(), 0.0)[:, None]
        dz = -p * (a + b * (z - ez[:, None]))
        dz.scatter_add_(1, yy[:, None], a)
        dz /= t
        gh[sl] = dz @ w64
        gw += dz.T @ h64[sl]
        del z, logp, p, dz
    return lp, ent, gh, gw


def check(
    n: int,
    hdim: int,
    v: int,
    dtype: torch.dtype,
    *,
    temperature: float = 1.0,
    strided: bool = False,
    mode: str | None = None,
) -> dict[str, Any]:
    """One case: error figures and pass flags (``mode``: the kernel's tile mode, default its default)."""
    dev = torch.device("cuda")
    registry.get_logprob_kernel("triton")  # the registry's choice must be available here
    mode = mode or impl.DEFAULT_MODE
    kernel = TritonLogprobKernel(registry.get_device(), mode=mode)
    if strided:
        h = torch.randn(hdim, n, device=dev).to(dtype).T
        w = (torch.randn(v, 2 * hdim, device=dev) * (2.5 / hdim**0.5)).to(dtype)[:, ::2]
    else:
        h = torch.randn(n, hdim, device=dev).to(dtype)
        w = (torch.randn(v, hdim, device=dev) * (2.5 / hdim**0.5)).to(dtype)
    y = torch.randint(0, v, (n,), device=dev)
    y[torch.rand(n, device=dev) < 0.1] = IGNORE_INDEX
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = kernel(hh, ww, y, temperature=temperature)
    assert out.entropy is not None
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    assert hh.grad is not None and ww.grad is not None
    rlp, rent, rgh, rgw = reference(h, w, y, temperature, g_lp, g_ent)
    lp_err = (out.log_probs.double() - rlp).abs()
    ent_err = (out.entropy.double() - rent).abs()
    grad_tol = 1e-5 if dtype == torch.float32 else 2.0**-8

    def rel(g: torch.Tensor, r: torch.Tensor) -> float:
        return float((g.double() - r).norm() / r.norm())

    ignored = y == IGNORE_INDEX
    res: dict[str, Any] = {
        "shape": [n, hdim, v],
        "dtype": str(dtype).replace("torch.", ""),
        "temperature": temperature,
        "strided": strided,
        "mode": mode,
        "first_call_s": round(first_s, 2),
        "lp_max_err": float(lp_err.max().detach()),
        "ent_max_err": float(ent_err.max()),
        "lp_ok": bool((lp_err <= 1e-3 + 2e-4 * rlp.abs()).all()),
        "ent_ok": bool((ent_err <= 5e-3 + 5e-4 * rent.abs()).all()),
        "gh_rel": rel(hh.grad, rgh),
        "gw_rel": rel(ww.grad, rgw),
        "gh_rel_of_rounded_ref": rel(rgh.to(dtype), rgh),
        "gw_rel_of_rounded_ref": rel(rgw.to(dtype), rgw),
        "ignored_zero": bool(
            (out.log_probs[ignored] == 0).all()
            and (out.entropy[ignored] == 0).all()
            and (hh.grad[ignored] == 0).all()
        ),
    }
    res["grad_ok"] = res["gh_rel"] <= grad_tol and res["gw_rel"] <= grad_tol
    res["ok"] = res["lp_ok"] and res["ent_ok"] and res["grad_ok"] and res["ignored_zero"]
    del hh, ww, h, w, rgh, rgw
    torch.cuda.empty_cache()
    return res


_CASES: list[tuple[int, int, int, torch.dtype, float, bool]] = [
    *((n, h, v, torch.bfloat16, 1.0 if i % 2 else 0.8, False) for i, (n, h, v) in enumerate(SHAPES)),
    (1000, 1024, 32000, torch.float32, 0.7, False),
    (1000, 1000, 32003, torch.float16, 1.0, False),
    (777, 1024, 50000, torch.bfloat16, 1.0, True),
    (20000, 4096, 32256, torch.bfloat16, 1.0, False),  # several backward row splits
]


@pytest.mark.parametrize(("n", "hdim", "v", "dtype", "temperature", "strided"), _CASES)
def test_triton_logprob_matches_float64_at_issue_shapes(
    n: int, hdim: int, v: int, dtype: torch.dtype, temperature: float, strided: bool
) -> None:
    torch.manual_seed(0)
    res = check(n, hdim, v, dtype, temperature=temperature, strided=strided)
    assert res["ok"], res


@pytest.mark.parametrize("mode", [m for m in impl.MODES if m != impl.DEFAULT_MODE])
@pytest.mark.parametrize(("n", "hdim", "v"), SHAPES)
def test_other_tile_mode_matches_float64(mode: str, n: int, hdim: int, v: int) -> None:
    torch.manual_seed(1)
    res = check(n, hdim, v, torch.bfloat16, temperature=0.8, mode=mode)
    assert res["ok"], res
