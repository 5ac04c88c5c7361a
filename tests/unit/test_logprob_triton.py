"""The Triton fused linear -> log-prob/entropy kernel, run on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are defined, so every interpreted check runs in a
child process (this file executed as a script) and reports JSON; the tests here read that report. This
keeps the interpreter out of the pytest process and away from other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from underlay.interfaces import IGNORE_INDEX, BackendUnavailable, InvalidInput, LogprobKernel

_ROOT = Path(__file__).resolve().parents[2]
_SRC = str(_ROOT / "src")


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-prob of ``labels`` and entropy; 0 at ignored positions."""
    z = hidden.double() @ weight.double().T / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != IGNORE_INDEX
    lp = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _case(
    name: str,
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype,
    *,
    temperature: float = 0.7,
    with_entropy: bool = True,
    strided: bool = False,
    **plan: Any,
) -> dict[str, Any]:
    """Run the fused kernel and the float64 reference on fresh inputs; return error figures."""
    from underlay.backends.cuda._logprob_triton import fused_linear_logprobs, tma_usable

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if strided:  # hidden as a transposed view, weight as every other row of a larger tensor
        hidden = torch.randn(h, n, generator=gen).to(dtype).T
        weight = (torch.randn(2 * v, h, generator=gen) * 0.4).to(dtype)[::2]
    else:
        hidden = torch.randn(n, h, generator=gen).to(dtype)
        weight = (torch.randn(v, h, generator=gen) * 0.4).to(dtype)
    labels = (
        torch.randint(0, v, (2 * n,), generator=gen)[::2]
        if strided
        else torch.randint(0, v, (n,), generator=gen)
    )
    labels[:: max(1, n // 5)] = IGNORE_INDEX
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    hid = hidden.detach().requires_grad_()
    wt = weight.detach().requires_grad_()
    lp, ent = fused_linear_logprobs(
        hid, wt, labels, temperature=temperature, with_entropy=with_entropy, **plan
    )
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
    loss.backward()
    hd = hidden.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_()
    rlp, rent = _reference(hd, wd, labels, temperature)
    ref_loss = (rlp * g_lp.double()).sum() + ((rent * g_ent.double()).sum() if with_entropy else 0.0)
    ref_loss.backward()
    assert hid.grad is not None and wt.grad is not None and hd.grad is not None and wd.grad is not None
    ignored = labels == IGNORE_INDEX
    return {
        "tma": plan.get("mode", "fused") == "fused" and tma_usable(hidden, weight, plan.get("tma", "store")),
        "tma_store": plan.get("tma", "store") == "store",
        "lp_err": (lp.double() - rlp).abs().max().item(),
        "ent_err": None if ent is None else (ent.double() - rent).abs().max().item(),
        "ent_none": ent is None,
        "out_dtype": str(lp.dtype),
        "gh_rel": ((hid.grad.double() - hd.grad).abs().max() / hd.grad.abs().max()).item(),
        "gw_rel": ((wt.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()).item(),
        "grad_dtypes": [str(hid.grad.dtype), str(wt.grad.dtype)],
        "ignored_zero": bool((lp[ignored] == 0).all() and (hid.grad[ignored] == 0).all()),
        "n_ignored": int(ignored.sum()),
    }


def _kernel_case(name: str, dtype: torch.dtype, **options: Any) -> dict[str, Any]:
    """``TritonLogprobKernel(device, **options)`` against the float64 reference, forward and backward,
    with the options it passed down to ``fused_linear_logprobs`` recorded (the real function runs)."""
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda import _logprob_triton as impl
    from underlay.backends.cuda.logprob import TritonLogprobKernel

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n, h, v = 13, 24, 50
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.4).to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::4] = IGNORE_INDEX
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    passed: dict[str, Any] = {}
    real = impl.fused_linear_logprobs

    def recording(*args: Any, **kw: Any) -> Any:
        passed.update(mode=kw.get("mode"), tma=kw.get("tma"))
        return real(*args, **kw)

    kernel = TritonLogprobKernel(CpuDevice(), **options)
    hid, wt = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    impl.fused_linear_logprobs = recording  # type: ignore[assignment]
    try:
        out = kernel(hid, wt, labels, temperature=0.9)
    finally:
        impl.fused_linear_logprobs = real  # type: ignore[assignment]
    assert out.entropy is not None
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = _reference(hd, wd, labels, 0.9)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    assert hid.grad is not None and wt.grad is not None and hd.grad is not None and wd.grad is not None
    return {
        "kernel": [kernel.mode, kernel.tma],
        "passed": [passed["mode"], passed["tma"]],
        "lp_err": (out.log_probs.double() - rlp).abs().max().item(),
        "ent_err": (out.entropy.double() - rent).abs().max().item(),
        "gh_rel": ((hid.grad.double() - hd.grad).abs().max() / hd.grad.abs().max()).item(),
        "gw_rel": ((wt.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()).item(),
    }


_KERNEL_OPTIONS: dict[str, dict[str, str]] = {
    "default": {},
    "fused_load": {"tma": "load"},
    "fused_off": {"mode": "fused", "tma": "off"},
    "hybrid": {"mode": "hybrid"},
}
"""Every option of ``TritonLogprobKernel`` the interpreter can run (hybrid never uses TMA)."""


def _cases() -> dict[str, dict[str, Any]]:
    return {
        "fp32": _case("fp32", 37, 48, 130, torch.float32),
        "fp32_chunks": _case("fp32_chunks", 37, 48, 130, torch.float32, row_split=16, v_chunk=64),
        "fp32_odd_h_strided": _case(
            "odd", 37, 50, 131, torch.float32, strided=True, temperature=1.3, row_split=16, v_chunk=40
        ),
        "bf16": _case("bf16", 37, 48, 130, torch.bfloat16, v_chunk=64),
        "bf16_pointer": _case("bf16_pointer", 37, 48, 130, torch.bfloat16, v_chunk=64, tma="off"),
        "bf16_tma_load": _case("bf16_load", 37, 48, 130, torch.bfloat16, v_chunk=64, tma="load"),
        "fp32_tma_store_chunks": _case(
            "fp32_store", 37, 48, 130, torch.float32, row_split=16, v_chunk=40, tma="store"
        ),
        "fp32_pointer": _case(
            "fp32_pointer", 37, 48, 130, torch.float32, row_split=16, v_chunk=64, tma="off"
        ),
        "fp16": _case("fp16", 29, 40, 97, torch.float16),
        "no_entropy": _case("noent", 21, 32, 70, torch.float32, with_entropy=False),
        # the default mode is fused; these run the cuBLAS-block ("hybrid") tiles
        "hybrid_fp32_chunks": _case(
            "hybrid", 37, 50, 131, torch.float32, row_split=16, v_chunk=64, mode="hybrid"
        ),
        "hybrid_bf16": _case("hybrid_bf16", 37, 48, 130, torch.bfloat16, mode="hybrid"),
        "kernel_options": {
            name: _kernel_case(name, torch.float32, **opts) for name, opts in _KERNEL_OPTIONS.items()
        },
    }


def _tp_check(rank: int, world: int) -> dict[str, float]:
    """Vocabulary-parallel run on this gloo rank against the unsharded float64 reference."""
    import torch.distributed as dist

    from underlay.backends.cuda._logprob_triton import fused_linear_logprobs

    gen = torch.Generator().manual_seed(7)  # same full inputs on every rank
    n, h, v = 23, 32, 2 * 45
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[3] = IGNORE_INDEX
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    shard = v // world
    hid = hidden.clone().requires_grad_()
    wt = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    lp, ent = fused_linear_logprobs(
        hid, wt, labels, temperature=0.9, group=dist.group.WORLD, label_offset=rank * shard
    )
    assert ent is not None
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = _reference(hd, wd, labels, 0.9)
    ((rlp * g_lp.double()).sum() + (rent * g_ent.double()).sum()).backward()
    assert hid.grad is not None and wt.grad is not None and hd.grad is not None and wd.grad is not None
    return {
        "lp_err": (lp.double() - rlp).abs().max().item(),
        "ent_err": (ent.double() - rent).abs().max().item(),
        "gh_err": (hid.grad.double() - hd.grad).abs().max().item(),
        "gw_err": (wt.grad.double() - wd.grad[rank * shard : (rank + 1) * shard]).abs().max().item(),
    }


def _child(rank: int, port: int, out: Path) -> None:
    """One of two gloo ranks: the vocab-parallel check on both, then rank 0 runs the single-process cases."""
    import torch.distributed as dist

    from tests._dist import join_group

    join_group(port, rank, 2)
    try:
        res: dict[str, Any] = {"tp": _tp_check(rank, 2)}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        res.update(_cases())
        from underlay.backends.cuda import _logprob_triton as impl

        res["tune_keys"] = {k: list(getattr(impl, k).keys) for k in ("_fwd_kernel", "_bwd_dlogits_kernel")}
    (out / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Error figures from two interpreted child processes (gloo ranks 0 and 1), run once per module."""
    from tests._dist import rendezvous_store

    out = tmp_path_factory.mktemp("logprob_triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    # the child imports underlay and tests._dist (it runs by path, so neither is on its sys.path)
    env["PYTHONPATH"] = os.pathsep.join([_SRC, str(_ROOT), env.get("PYTHONPATH", "")])
    store = rendezvous_store(2, timeout_s=300)
    port = str(store.port)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


@pytest.mark.parametrize(
    "case",
    [
        "fp32",
        "fp32_chunks",
        "fp32_odd_h_strided",
        "fp32_pointer",
        "fp32_tma_store_chunks",
        "no_entropy",
        "hybrid_fp32_chunks",
    ],
)
def test_fp32_matches_float64_reference(report: dict[int, dict[str, Any]], case: str) -> None:
    r = report[0][case]
    assert r["out_dtype"] == "torch.float32"
    assert r["lp_err"] < 2e-5
    if case == "no_entropy":
        assert r["ent_none"]
    else:
        assert r["ent_err"] < 2e-5
    assert r["gh_rel"] < 1e-5 and r["gw_rel"] < 1e-5
    assert r["grad_dtypes"] == ["torch.float32", "torch.float32"]


@pytest.mark.parametrize(
    ("case", "ulp"),
    [
        ("bf16", 2.0**-8),
        ("bf16_pointer", 2.0**-8),
        ("bf16_tma_load", 2.0**-8),
        ("fp16", 2.0**-11),
        ("hybrid_bf16", 2.0**-8),
    ],
)
def test_half_precision_within_rounding(report: dict[int, dict[str, Any]], case: str, ulp: float) -> None:
    r = report[0][case]
    assert r["lp_err"] < 1e-3 and r["ent_err"] < 5e-3
    # dlogits are rounded to the input dtype once; gradients stay within a few units of that rounding
    assert r["gh_rel"] < 4 * ulp and r["gw_rel"] < 4 * ulp
    dt = "torch.float16" if case == "fp16" else "torch.bfloat16"
    assert r["grad_dtypes"] == [dt, dt]


def test_both_tile_load_paths_are_exercised(report: dict[int, dict[str, Any]]) -> None:
    """The TMA-descriptor loads where operands are aligned row-major; pointer loads for a strided or
    misaligned operand (odd H), when forced, and in hybrid mode."""
    r = report[0]
    assert r["fp32"]["tma"] and r["bf16"]["tma"] and r["fp32_chunks"]["tma"] and r["fp16"]["tma"]
    assert (
        not r["fp32_odd_h_strided"]["tma"] and not r["bf16_pointer"]["tma"] and not r["fp32_pointer"]["tma"]
    )
    assert not r["hybrid_bf16"]["tma"]
    # the default stores dlogits through TMA too; "load" keeps the masked pointer store
    assert r["bf16"]["tma_store"] and r["fp32_tma_store_chunks"]["tma_store"]
    assert r["bf16_tma_load"]["tma"] and not r["bf16_tma_load"]["tma_store"]


def test_kernel_options_reach_the_kernels_and_match_float64(report: dict[int, dict[str, Any]]) -> None:
    """Each mode / TMA option of ``TritonLogprobKernel`` is what the kernel object reports and what it
    passes to the Triton path (defaults: fused, store), and the result matches the float64 reference."""
    got = report[0]["kernel_options"]
    assert set(got) == set(_KERNEL_OPTIONS)
    for name, opts in _KERNEL_OPTIONS.items():
        r = got[name]
        want = [opts.get("mode", "fused"), opts.get("tma", "store")]
        assert r["kernel"] == want and r["passed"] == want, (name, r)
        assert r["lp_err"] < 2e-5 and r["ent_err"] < 2e-5, (name, r)
        assert r["gh_rel"] < 1e-5 and r["gw_rel"] < 1e-5, (name, r)


def test_ignore_index_gives_zero_and_no_gradient(report: dict[int, dict[str, Any]]) -> None:
    for name, r in report[0].items():
        if name in ("tp", "tune_keys", "kernel_options"):
            continue
        assert r["n_ignored"] > 0, name
        assert r["ignored_zero"], name


@pytest.mark.distributed
def test_vocab_parallel_two_gloo_ranks_match_unsharded(report: dict[int, dict[str, Any]]) -> None:
    for rank in range(2):
        r = report[rank]["tp"]
        assert r["lp_err"] < 2e-5 and r["ent_err"] < 2e-5, r
        assert r["gh_err"] < 2e-5 and r["gw_err"] < 2e-5, r


def _inputs(**kw: Any) -> dict[str, Any]:
    n, h, v = 5, 8, 11
    args: dict[str, Any] = {
        "hidden": torch.randn(n, h),
        "weight": torch.randn(v, h),
        "labels": torch.randint(0, v, (n,)),
    }
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"hidden": torch.randn(5, 9)}, "hidden size mismatch"),
        ({"hidden": torch.randn(5, 8, 1)}, r"\[N, H\]"),
        ({"labels": torch.randint(0, 11, (4,))}, "labels must be"),
        ({"labels": torch.randint(0, 11, (5,)).int()}, "int64"),
        ({"labels": torch.tensor([0, 1, 11, 2, 3])}, "found 11"),
        ({"labels": torch.tensor([0, -5, 1, 2, 3])}, "found -5"),
        ({"weight": torch.randn(11, 8).double()}, "dtype"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_input_is_rejected_before_launch(kw: dict[str, Any], match: str) -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.logprob import TritonLogprobKernel

    args = _inputs(**kw)
    temperature = args.pop("temperature", 1.0)
    with pytest.raises(InvalidInput, match=match):
        TritonLogprobKernel(CpuDevice())(**args, temperature=temperature)


def test_cpu_tensors_need_the_interpreter() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda.logprob import TritonLogprobKernel

    kernel = TritonLogprobKernel(CpuDevice())
    assert kernel.name == "triton"
    assert isinstance(kernel, LogprobKernel)
    with pytest.raises(InvalidInput, match="UNDERLAY_LOGPROB_KERNEL=torch"):
        kernel(**_inputs())


def test_unknown_options_are_config_errors() -> None:
    from underlay.backends.cpu.device import CpuDevice
    from underlay.backends.cuda import _logprob_triton as impl
    from underlay.backends.cuda.logprob import TritonLogprobKernel
    from underlay.interfaces import ConfigError

    args = (torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match=r"mode must be one of hybrid, fused, got 'bogus'"):
        impl.fused_linear_logprobs(*args, mode="bogus")
    with pytest.raises(ConfigError, match=r"tma must be one of store, load, off, got 'on'"):
        impl.fused_linear_logprobs(*args, tma="on")
    with pytest.raises(ConfigError, match=r"TritonLogprobKernel\(mode=...\).*'tiled'"):
        TritonLogprobKernel(CpuDevice(), mode="tiled")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"TritonLogprobKernel\(tma=...\).*'True'"):
        TritonLogprobKernel(CpuDevice(), tma="True")  # type: ignore[arg-type]
    kernel = TritonLogprobKernel(CpuDevice())
    assert (kernel.mode, kernel.tma) == (impl.DEFAULT_MODE, impl.DEFAULT_TMA) == ("fused", "store")
    kernel = TritonLogprobKernel(CpuDevice(), mode="hybrid", tma="off")
    assert (kernel.mode, kernel.tma) == ("hybrid", "off")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_registry_refuses_triton_without_cuda() -> None:
    from underlay import registry

    with pytest.raises(BackendUnavailable):
        registry.get_logprob_kernel("triton")


def test_autotune_key_ignores_per_batch_sizes(report: dict[int, dict[str, Any]]) -> None:
    """Token count and vocabulary-chunk width change with every micro-batch; were they in the autotune
    key, a training step would re-tune (compile and time every config) whenever a new one came (seen on
    the H200 as one-time 3-4 s steps)."""
    for kernel, keys in report[0]["tune_keys"].items():
        assert "N" not in keys and "V" not in keys, (kernel, keys)
        assert "H" in keys, (kernel, keys)


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
