"""The ``LogprobKernel`` contract, run against every registered log-prob kernel whose probe passes here.

Each check compares the kernel with a float64 ``log_softmax`` reference on fresh random inputs: log-probs,
entropy and the gradients of hidden and weight, ``IGNORE_INDEX`` rows (0 and no gradient), temperature,
row independence across chunk boundaries, ``with_entropy=False``, an empty batch, dtype support through
``supports`` and refusal of bad input with ``InvalidInput``. Tolerances follow the input dtype.

Kernels whose probe fails are reported as skips with the probe's reason. On a host without a GPU the
``triton`` kernel still runs the whole contract through Triton's interpreter (``TRITON_INTERPRET=1``) at
small sizes, in a child process (this file run as a script) so the interpreter never reaches pytest.
On a GPU host: ``UNDERLAY_DEVICE=cuda pytest tests/conformance``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.conformance._interpret import interpret_skip_reason, report_checks, run_interpreted
from underlay import registry
from underlay.interfaces import IGNORE_INDEX, InvalidInput, LogprobKernel

# Per input dtype: (max |err| of log-prob and entropy, max relative error of the gradients). The gradient
# bound is relative to the largest reference gradient. Half-precision kernels round logits or dlogits to
# the input dtype once; the bounds are a few units of that rounding at |logits| of a few units.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (5e-5, 5e-5),
    torch.bfloat16: (6e-2, 3e-2),
    torch.float16: (8e-3, 4e-3),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _params() -> list[Any]:
    """One param per registered logprob backend: runnable here, or skipped with the probe's reason."""
    device = registry.resolve("device").name
    out: list[Any] = []
    for spec in registry.backends("logprob"):
        probe = registry.probe("logprob", spec.name)
        if probe.available and spec.works_with(device):
            out.append(pytest.param(spec.name, id=spec.name))
        else:
            why = probe.reason or f"needs device {list(spec.devices)}, this host runs {device!r}"
            out.append(pytest.param(spec.name, id=spec.name, marks=pytest.mark.skip(reason=why)))
    registry.reset()
    return out


# ------------------------------------------------------------------------------------ the contract


def _sizes(dev: torch.device) -> tuple[int, int, int]:
    """(N, H, V) of the accuracy checks: small under the interpreter/CPU, larger on an accelerator.
    V is odd (no tile divides it); H is not a power of two."""
    return (37, 40, 131) if dev.type == "cpu" else (1500, 320, 33_001)


def _chunk_rows(dev: torch.device) -> tuple[int, ...]:
    """Batch sizes of the row-independence check: around 16-row tiles, 2-tile groups and more tiles than
    the interpreter's 3 persistent programs on the CPU (Triton's interpreter runs 16-row tiles, the
    torch kernel keeps such batches in one chunk); around the 64- and 128-row tiles of GPU kernels
    elsewhere."""
    return (1, 15, 16, 17, 31, 32, 33, 49) if dev.type == "cpu" else (1, 15, 16, 17, 63, 64, 65, 129)


def _inputs(
    seed: str, n: int, h: int, v: int, dtype: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (n,), generator=gen)
    if n:
        labels[:: max(1, n // 6)] = IGNORE_INDEX
    return hidden.to(dev, dtype), weight.to(dev, dtype), labels.to(dev)


def _reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-prob of ``labels`` and entropy of ``softmax(hidden @ weight.T / T)`` (with ``softcap``
    ``c``: of ``softmax(c * tanh(hidden @ weight.T / c) / T)``); 0 where ignored."""
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != IGNORE_INDEX
    lp = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _run(
    kernel: LogprobKernel,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    temperature: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    kw = {} if softcap is None else {"softcap": softcap}
    out = kernel(h, w, labels, temperature=temperature, with_entropy=g_ent is not None, **kw)
    loss = (out.log_probs.double() * g_lp).sum()
    if out.entropy is not None and g_ent is not None:
        loss = loss + (out.entropy.double() * g_ent).sum()
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), h.grad, w.grad


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_protocol(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """The kernel satisfies the protocol and carries its registry name."""
    assert isinstance(kernel, LogprobKernel), type(kernel)
    assert kernel.name == name


def check_matches_float64(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """Log-probs, entropy and both gradients agree with float64 for every dtype the kernel supports;
    outputs are fp32 (fp64 for fp64 input), gradients have the input dtype."""
    n, h, v = _sizes(dev)
    dtypes = [*DTYPES, *(() if kernel.supports(torch.float64) else (torch.float64,))]
    for dtype in dtypes:
        assert kernel.supports(dtype) == (), (dtype, kernel.supports(dtype))
        hidden, weight, labels = _inputs(f"{name}/{dtype}", n, h, v, dtype, dev)
        gen = torch.Generator().manual_seed(n)
        g_lp = torch.randn(n, generator=gen, dtype=torch.float64).to(dev)
        g_ent = torch.randn(n, generator=gen, dtype=torch.float64).to(dev)
        lp, ent, gh, gw = _run(kernel, hidden, weight, labels, g_lp, g_ent, 0.7)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert lp.dtype == out_dtype and ent is not None and ent.dtype == out_dtype, (dtype, lp.dtype)
        assert lp.shape == (n,) and ent.shape == (n,)
        assert (
            gh.dtype == dtype and gw.dtype == dtype and gh.shape == hidden.shape and gw.shape == weight.shape
        )
        hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
        rlp, rent = _reference(hd, wd, labels, 0.7)
        ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
        assert hd.grad is not None and wd.grad is not None
        val_tol, grad_tol = TOL[dtype]
        # A kernel may round the logits to the input dtype (torch's matmul does): each logit z/T is then
        # off by up to eps/2 * |z/T|, and log-prob and entropy by up to two such roundings.
        zmax = float((hd.detach() @ wd.detach().T).abs().max()) / 0.7
        val_tol = max(val_tol, torch.finfo(dtype).eps * zmax)
        err_lp = float((lp.double() - rlp.detach()).abs().max())
        err_ent = float((ent.double() - rent.detach()).abs().max())
        assert err_lp <= val_tol and err_ent <= val_tol, (
            f"{dtype}: lp err {err_lp:.3g}, ent err {err_ent:.3g}"
        )
        e_h, e_w = _rel(gh, hd.grad), _rel(gw, wd.grad)
        assert e_h <= grad_tol and e_w <= grad_tol, f"{dtype}: grad_hidden {e_h:.3g}, grad_weight {e_w:.3g}"


def check_ignore_index(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """``IGNORE_INDEX`` rows give log-prob 0, entropy 0 and no hidden gradient; all-ignored gives zeros."""
    n, h, v = 19, 24, 53
    hidden, weight, labels = _inputs(f"ignore/{name}", n, h, v, torch.float32, dev)
    labels[3:7] = IGNORE_INDEX
    ignored = labels == IGNORE_INDEX
    g = torch.randn(n, dtype=torch.float64).to(dev)
    lp, ent, gh, _ = _run(kernel, hidden, weight, labels, g, g.flip(0), 1.0)
    assert ent is not None
    assert bool((lp[ignored] == 0).all() and (ent[ignored] == 0).all())
    assert bool((gh[ignored] == 0).all()) and bool((gh[~ignored] != 0).any())
    all_ignored = torch.full_like(labels, IGNORE_INDEX)
    lp, ent, gh, gw = _run(kernel, hidden, weight, all_ignored, g, g, 1.0)
    assert ent is not None
    assert not lp.any() and not ent.any() and not gh.any() and not gw.any()


def check_temperature(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """``temperature=T`` equals temperature 1 on ``hidden / T``, and matches the float64 reference."""
    n, h, v = 23, 32, 97
    hidden, weight, labels = _inputs(f"temp/{name}", n, h, v, torch.float32, dev)
    for t in (0.25, 1.0, 3.0):
        out = kernel(hidden, weight, labels, temperature=t)
        ref = kernel(hidden / t, weight, labels, temperature=1.0)  # exact: T is a power of two or 3
        rlp, rent = _reference(hidden, weight, labels, t)
        assert out.entropy is not None and ref.entropy is not None
        assert float((out.log_probs.double() - rlp).abs().max()) <= TOL[torch.float32][0] * 4, t
        assert float((out.entropy.double() - rent).abs().max()) <= TOL[torch.float32][0] * 4, t
        assert torch.allclose(out.log_probs, ref.log_probs, atol=1e-5, rtol=0), t


def check_chunk_boundaries(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """Rows are independent: any batch equals its rows computed in pieces, at sizes around the usual
    tile/chunk boundaries; ``with_entropy=False`` gives the same log-probs and ``entropy=None``."""
    h, v = 16, 67
    for n in _chunk_rows(dev):
        hidden, weight, labels = _inputs(f"chunks/{name}/{n}", n, h, v, torch.float32, dev)
        full = kernel(hidden, weight, labels)
        cut = max(1, n // 3)
        parts = [kernel(hidden[a:b], weight, labels[a:b]) for a, b in ((0, cut), (cut, n)) if b > a]
        lp = torch.cat([p.log_probs for p in parts])
        assert full.entropy is not None
        ent = torch.cat([p.entropy for p in parts if p.entropy is not None])
        assert torch.allclose(full.log_probs, lp, atol=2e-6, rtol=0), n
        assert torch.allclose(full.entropy, ent, atol=2e-6, rtol=0), n
        rlp, _ = _reference(hidden, weight, labels, 1.0)
        assert float((full.log_probs.double() - rlp).abs().max()) <= TOL[torch.float32][0], n
        no_ent = kernel(hidden, weight, labels, with_entropy=False)
        assert no_ent.entropy is None
        assert torch.allclose(no_ent.log_probs, full.log_probs, atol=2e-6, rtol=0), n


def check_empty_batch(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """N = 0 gives empty outputs and a zero weight gradient."""
    hidden, weight, labels = _inputs(f"empty/{name}", 0, 16, 33, torch.float32, dev)
    w = weight.clone().requires_grad_()
    out = kernel(hidden, w, labels)
    assert out.log_probs.shape == (0,) and out.entropy is not None and out.entropy.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert w.grad is None or not w.grad.any()


def check_refuses_bad_input(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """Bad shapes, dtypes, labels and temperatures raise ``InvalidInput`` before anything runs; an
    unsupported dtype raises with the reason ``supports`` gives."""
    n, h, v = 5, 8, 11
    good = {
        "hidden": torch.randn(n, h).to(dev),
        "weight": torch.randn(v, h).to(dev),
        "labels": torch.randint(0, v, (n,)).to(dev),
    }
    bad: list[tuple[dict[str, Any], float]] = [
        ({"hidden": torch.randn(n, h + 1).to(dev)}, 1.0),
        ({"hidden": torch.randn(n, h, 1).to(dev)}, 1.0),
        ({"weight": torch.randn(v).to(dev)}, 1.0),
        ({"labels": torch.randint(0, v, (n - 1,)).to(dev)}, 1.0),
        ({"labels": torch.tensor([0, 1, v, 2, 3]).to(dev)}, 1.0),
        ({"labels": torch.tensor([0, -5, 1, 2, 3]).to(dev)}, 1.0),
        ({"weight": torch.randn(v, h).to(dev, torch.bfloat16)}, 1.0),
        ({"hidden": torch.randint(0, 3, (n, h)).to(dev), "weight": torch.randint(0, 3, (v, h)).to(dev)}, 1.0),
        ({}, 0.0),
        ({}, -1.0),
        ({}, float("nan")),
        ({}, float("inf")),
    ]
    for over, temperature in bad:
        args = {**good, **over}
        try:
            kernel(**args, temperature=temperature)
        except InvalidInput:
            continue
        raise AssertionError(f"accepted bad input {sorted(over)} temperature={temperature}")
    for dtype in (torch.float64, torch.int32):
        reasons = kernel.supports(dtype)
        assert all(isinstance(r, str) and r for r in reasons)
        if reasons:
            try:
                kernel(good["hidden"].to(dtype), good["weight"].to(dtype), good["labels"])
            except InvalidInput:
                continue
            raise AssertionError(f"{dtype} is unsupported ({reasons}) but the call was accepted")
    assert kernel.supports(torch.int32), "int32 is not a dtype a log-prob kernel can take"


def check_softcap(kernel: LogprobKernel, name: str, dev: torch.device) -> None:
    """Gemma's final-logit cap ``c * tanh(z / c)`` before the temperature: log-probs, entropy and both
    gradients against float64 for caps that bend the logits (2.5) and barely touch them (30), at two
    temperatures; ``softcap=None`` and ``0`` equal the uncapped call; a negative or NaN cap is refused."""
    n, h, v = _sizes(dev)
    for dtype in (torch.float32, torch.bfloat16):
        if kernel.supports(dtype):
            continue
        tol, gtol = TOL[dtype]
        for cap, temperature in ((2.5, 1.0), (30.0, 0.7), (2.5, 0.7)):
            hidden, weight, labels = _inputs(f"{name}-cap-{cap}-{temperature}-{dtype}", n, h, v, dtype, dev)
            if dtype == torch.float32:  # logits of tens: the cap of 2.5 saturates many of them (half
                hidden = hidden * 4  # precision rounds logits of that size beyond its tolerance)
            gen = torch.Generator().manual_seed(int(cap * 10))
            g_lp = torch.randn(n, generator=gen, dtype=torch.float64).to(dev)
            g_ent = torch.randn(n, generator=gen, dtype=torch.float64).to(dev)
            lp, ent, gh, gw = _run(kernel, hidden, weight, labels, g_lp, g_ent, temperature, cap)
            hd = hidden.double().requires_grad_()
            wd = weight.double().requires_grad_()
            rlp, rent = _reference(hd, wd, labels, temperature, cap)
            ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
            assert ent is not None and hd.grad is not None and wd.grad is not None
            where = f"{name} {dtype} softcap={cap} T={temperature}"
            assert float((lp.double() - rlp).abs().max()) <= tol, where
            assert float((ent.double() - rent).abs().max()) <= tol, where
            assert _rel(gh, hd.grad) <= gtol and _rel(gw, wd.grad) <= gtol, where
    hidden, weight, labels = _inputs(f"{name}-cap-none", n, h, v, torch.float32, dev)
    plain = kernel(hidden, weight, labels)
    for off in (None, 0.0):
        same = kernel(hidden, weight, labels, softcap=off)
        assert torch.equal(same.log_probs, plain.log_probs), off
    for bad in (-1.0, float("nan"), float("inf")):
        try:
            kernel(hidden, weight, labels, softcap=bad)
        except InvalidInput:
            continue
        raise AssertionError(f"accepted softcap={bad}")


CHECKS: dict[str, Callable[[LogprobKernel, str, torch.device], None]] = {
    "softcap": check_softcap,
    "protocol": check_protocol,
    "matches_float64": check_matches_float64,
    "ignore_index": check_ignore_index,
    "temperature": check_temperature,
    "chunk_boundaries": check_chunk_boundaries,
    "empty_batch": check_empty_batch,
    "refuses_bad_input": check_refuses_bad_input,
}


# ------------------------------------------------------------------------------------ in process


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", _params())
def test_logprob_contract(name: str, check: str) -> None:
    kernel = registry.get_logprob_kernel(name)
    dev = registry.get_device().torch_device()
    CHECKS[check](kernel, name, dev)


# ------------------------------------------------------------- the triton kernel under the interpreter


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every check on ``TritonLogprobKernel`` over CPU tensors, in a ``TRITON_INTERPRET=1`` child."""
    return run_interpreted(__file__)


@pytest.mark.skipif(
    interpret_skip_reason("test_logprob_contract") is not None,
    reason=str(interpret_skip_reason("test_logprob_contract")),
)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_triton_contract_interpreted(interpreted: dict[str, str], check: str) -> None:
    assert interpreted[check] == "ok", interpreted[check]


def _child() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.logprob import TritonLogprobKernel

    report_checks(CHECKS, TritonLogprobKernel(CpuDevice()))


if __name__ == "__main__":
    _child()
