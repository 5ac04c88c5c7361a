"""HostOffloadAdamW on a CUDA GPU: bit-identical to torch's fused AdamW every step, and its state kept
off the device (the step's device memory above parameters and gradients is far below the device
AdamW's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay.engines.fsdp2.optim_offload import HostOffloadAdamW

pytestmark = pytest.mark.gpu

HP: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_offloaded_adamw_is_bit_identical_to_fused_adamw_every_step() -> None:
    """Random fp32 parameters of several shapes, small chunks (many streamed chunks), 5 steps."""
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    shapes = [(257, 129), (1024,), (64, 64, 3), (3000, 17), (5,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    a = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref = torch.optim.AdamW(a, **HP, fused=True)
    off = HostOffloadAdamW(b, **HP, fused=True, chunk_bytes=50_000, pin_memory=True)
    assert len(off._chunks(b)) > 1
    for step in range(5):
        grads = [torch.randn(s, generator=g).to(device) for s in shapes]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.step()
        off.step()
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), (step, i)


def _step_peak_gib(offload: bool, numel: int) -> float:
    # many parameters: a streamed chunk holds whole parameters' state, so one 200M-element parameter
    # would be one chunk as large as the whole state
    params = [torch.nn.Parameter(torch.randn(numel // 200, device="cuda")) for _ in range(200)]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt: torch.optim.Optimizer = (
        HostOffloadAdamW(params, **HP, fused=True, chunk_bytes=8 << 20, pin_memory=True)
        if offload
        else torch.optim.AdamW(params, **HP, fused=True)
    )
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del opt, params
    torch.cuda.empty_cache()
    return peak


def test_offloaded_state_stays_off_the_device() -> None:
    """200M fp32 parameter elements (200 parameters): the device AdamW holds its two states (1.6 GB);
    the offloaded one streams 8 MiB chunks, so it holds well under a tenth of that."""
    numel = 200_000_000
    device_peak, offload_peak = _step_peak_gib(False, numel), _step_peak_gib(True, numel)
    assert device_peak >= 2 * 4 * numel / 2**30 * 0.99, device_peak
    assert offload_peak < 0.1 * device_peak, (offload_peak, device_peak)
