"""Blockwise FP8 (e4m3) quantisation on one GPU, for every Triton kernel variant: bit-identity with the torch
quantiser and throughput as a fraction of the measured copy bandwidth (issue 9, item 6; goal >= 70 %).

For each kernel variant of ``fp8_variants.py`` beside this script (``VARIANTS``, or ``--variants a,b`` /
``FP8_VARIANTS=a,b``; the library's ``underlay.backends.cuda.fp8`` kernel is the variant
``DEFAULT_VARIANT``, also timed through the registry as ``triton`` in the baseline):

* exactness: the correctness cases below (partial edge tiles, bf16/fp16/fp32, blocks (128, 128) and
  (64, 96), tiles of widely different magnitude, an all-zero tile) plus adversarial tiles (exact e4m3
  midpoints after division, their neighbours, all-equal tiles, e4m3-subnormal results, signed zeros,
  scales outside the reciprocal range, all-ones significands), and the 16384 x 8192 throughput weight:
  quantise must give the torch quantiser's q bytes and scales, dequantise (bf16/fp16/fp32, from the
  torch q and scales) its values, bit for bit;
* the library kernel (the registry's ``triton`` quantiser) is checked on the same cases and timed first;
* throughput on a 16384 x 8192 bf16 weight (256 MiB): bytes moved = read + write (quantise: 2 + 1 bytes
  per element + scales; dequantise: 1 + 2 + scales), against a 1 GiB device-to-device ``copy_``
  (2 x size bytes). Times are CUDA-event medians of 10 back-to-back calls (so host launch overhead is
  hidden, as in a pipeline), after autotuning.

Phase 1 checks exactness in parallel child processes, one per variant (``FP8_BENCH_JOBS``, default
min(8, CPUs / 2)), and compiles every launch configuration of the throughput shape into Triton's disk
cache; phase 2 times the variants one after the other in one child (autotuning then only benchmarks).
Prints one line per variant (``variant <name>: exact <bool> quantise <ms> <GB/s> (<pct>% of copy);
dequantise ...``) as soon as it is timed, then the fastest exact variant for each of quantise and
dequantise. A variant that fails (compile error, bad result, even a crash of its child) is reported and
the others carry on. Stops starting variants after ``FP8_BENCH_BUDGET_S`` seconds (default 480).
Writes ``$OUT/bench_fp8.json`` after each variant.

Run (repo root): ``PYTHONPATH=src python3 benchmarks/gpu/bench_fp8.py [--variants a,b]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_variants

_SMOKE = os.environ.get("FP8_BENCH_SMOKE") == "1"  # CPU dry run of this script (TRITON_INTERPRET=1, tiny)
_DEV = "cpu" if _SMOKE else "cuda"
_TAG = "@@fp8 "
_CHILD_CMD = [sys.executable, os.path.abspath(__file__)]
_SHAPES = [
    (4096, 4096, torch.bfloat16, (128, 128)),
    (1000, 3000, torch.bfloat16, (128, 128)),
    (777, 1313, torch.float16, (128, 128)),
    (513, 257, torch.float32, (128, 128)),
    (300, 500, torch.bfloat16, (64, 96)),
    (151936, 896, torch.bfloat16, (128, 128)),
]
_ADVERSARIAL = [(torch.bfloat16, (128, 128)), (torch.float16, (64, 96)), (torch.float32, (128, 128))]
_THROUGHPUT = (128, 512) if _SMOKE else (16384, 8192)
if _SMOKE:
    _SHAPES = _SHAPES[1:5]
# promising variants first, so a cut run still answers the main question
_PRIORITY = ["rcp-ptx-t1", "rcp-ptx-t2", "rcp-cast-t1", "div-ptx-t1", "div-cast-t1", "div-sw-t1", "rcp-sw-t1"]


def quantizer(name: str) -> Any:
    """The registry's quantiser ``name``, or the class itself when the registry lacks quant specs."""
    from underlay import registry

    try:
        return registry.get_quantizer(name)
    except Exception as exc:
        print(f"registry.get_quantizer({name!r}) failed ({type(exc).__name__}); using the class directly")
        if name == "triton":
            from underlay.backends.cuda.fp8 import TritonFp8Quantizer

            return TritonFp8Quantizer(device())
        from underlay.backends.portable.quant import TorchFp8Quantizer

        return TorchFp8Quantizer(device())


def gpu_name() -> str:
    return "cpu (FP8_BENCH_SMOKE)" if _SMOKE else torch.cuda.get_device_name()


def device() -> Any:
    """The underlay Device the quantisers are built with."""
    if _SMOKE:
        from underlay.backends.cpu.device import CpuDevice

        return CpuDevice()
    from underlay.backends.cuda.device import CudaDevice

    return CudaDevice()


def median_ms(fn: Callable[[], object], reps: int = 15, batch: int = 10) -> float:
    """Median over ``reps`` of the CUDA-event time of ``batch`` back-to-back calls, per call (3 warm-ups)."""
    if _SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def sample(m: int, k: int, dtype: torch.dtype, block: tuple[int, int], seed: int) -> torch.Tensor:
    """Random weight whose tiles span ~16 binades, with one all-zero tile."""
    gen = torch.Generator(device=_DEV).manual_seed(seed)
    w = torch.randn(m, k, device=_DEV, generator=gen)
    mb, kb = -(-m // block[0]), -(-k // block[1])
    tile_scale = torch.exp2(torch.randint(-12, 4, (mb, kb), device=_DEV, generator=gen).float())
    w *= tile_scale.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :k]
    w[: block[0], : block[1]] = 0
    return w.to(dtype)


def adversarial(dtype: torch.dtype, block: tuple[int, int], seed: int) -> torch.Tensor:
    """A 4 x 6-tile weight (last tile row/column partial) whose tiles stress the rounding, on the GPU."""
    bm, bk = block
    gen = torch.Generator().manual_seed(seed)
    tm, tk = 4, 6
    w = torch.zeros(tm * bm, tk * bk)
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    ibits = torch.int32 if dtype == torch.float32 else torch.int16
    tiny, huge = (2.0**-14, 6.0e4) if dtype == torch.float16 else (1e-30, 1e38)
    for i in range(tm):
        for j in range(tk):
            kind = (i * tk + j) % 12
            t = w[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
            n = t.numel()
            sgn = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0)
            s0 = 0.1875 * 2.0 ** (kind - 4)  # amax = 448 * s0 exactly, so the scale is s0
            if kind in (0, 1):  # exact midpoints after division, or one input ulp away
                v = (mids[torch.randint(0, len(mids), (n,), generator=gen)] * s0).to(dtype)
                if kind == 1:
                    v = (v.view(ibits) + (torch.randint(0, 2, (n,), generator=gen).to(ibits) * 2 - 1)).view(
                        dtype
                    )
                t.copy_(v.float().view_as(t) * sgn)
                t[0, 0] = 448 * s0
            elif kind == 2:
                t.fill_(-0.3)
            elif kind == 3:  # e4m3 subnormals, their midpoints, values below; signed zeros
                sub = (torch.randint(0, 16, t.shape, generator=gen).float() * 0.5 + 0.25) * 2.0**-9
                t.copy_(sub * s0 * torch.exp2(-torch.randint(0, 4, t.shape, generator=gen).float()) * sgn)
                t[0, :4] = torch.tensor([448 * s0, -0.0, 0.0, -s0 * 2.0**-12])
            elif kind == 4:
                t.copy_(torch.randn(t.shape, generator=gen) * tiny)
            elif kind == 5:
                t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * huge)
            elif kind == 6:
                t.copy_(torch.rand(t.shape, generator=gen) * sgn * 5)
                t[1, 1] = (2 - 2.0**-7) * 4 if dtype != torch.float32 else (2 - 2.0**-23) * 4
            elif kind == 7:
                t.fill_(-0.0)
                t[bm // 2, bk // 3] = -2.5
            elif kind == 11:
                t.zero_()
            else:
                t.copy_(
                    torch.randn(t.shape, generator=gen)
                    * 2.0 ** float(torch.randint(-20, 20, (1,), generator=gen))
                )
    return w[: -(bm // 3), : -(bk // 5)].to(dtype).to(_DEV)


def compare(
    tq: Any, w: torch.Tensor, block: tuple[int, int], dequant: bool = True, strided: bool = False
) -> dict[str, bool]:
    """Quantise (and dequantise, from the reference q and scales, to bf16/fp16/fp32) with ``tq`` and
    with the torch reference; bit-identity flags (``dequant`` is True when not checked). ``strided``:
    dequantise from column-major copies of q and the scales."""
    from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

    q1, s1 = tq.quantize(w, block)
    q2, s2 = quantize_fp8_blockwise(w, block)
    qd, sd = (q2.T.contiguous().T, s2.T.contiguous().T) if strided else (q2, s2)
    deq = not dequant or all(
        torch.equal(tq.dequantize(qd, sd, block, dt), dequantize_fp8_blockwise(q2, s2, block, dt))
        for dt in (torch.bfloat16, torch.float16, torch.float32)
    )
    return {
        "quant": bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)),
        "dequant": bool(deq),
    }


def dequant_key(name: str) -> str:
    """Variants with one dequantisation kernel share this key (the division does not matter there)."""
    return name.split("-", 1)[1]


def best_config(kernel: Any) -> str:
    """``"<warps>w[/<regs>r]"`` of an autotuned kernel's last choice, or ``"?"``."""
    cfg = getattr(kernel, "best_config", None)
    if cfg is None:
        return "?"
    regs = getattr(cfg, "maxnreg", None)
    return f"{cfg.num_warps}w" + (f"/{regs}r" if regs else "")


def check_variant(name: str, dequant: bool) -> dict[str, Any]:
    """Phase 1 (child): exactness of one variant on every case; then every launch configuration of the
    throughput shape is compiled (into Triton's disk cache) and checked too. ``dequant`` False: the
    dequantisation kernel is another variant's (``dequant_key``) and is checked there."""
    from underlay.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

    fp8 = fp8_variants
    tq = fp8.VariantFp8Quantizer(device(), variant=name)
    t0 = time.time()
    fp8.AUTOTUNE = False  # the result does not depend on the launch configuration
    cases = []
    for i, (m, k, dt, block) in enumerate(_SHAPES):
        w = sample(m, k, dt, block, seed=i)
        cases.append({"case": f"{m}x{k} {dt} {block}", **compare(tq, w, block, dequant)})
    w = sample(777, 1313, torch.bfloat16, (128, 128), seed=99).T.contiguous().T  # strided input
    cases.append({"case": "strided 777x1313 bf16", **compare(tq, w, (128, 128), dequant, strided=True)})
    for j, (dt, block) in enumerate(_ADVERSARIAL):
        cases.append(
            {
                "case": f"adversarial {dt} {block}",
                **compare(tq, adversarial(dt, block, seed=j), block, dequant),
            }
        )
    m, k = _THROUGHPUT
    w = throughput_weight()
    q_ref, s_ref = quantize_fp8_blockwise(w)
    d_ref = dequantize_fp8_blockwise(q_ref, s_ref)
    fp8.AUTOTUNE = True  # (the forced configurations below are launched directly)
    for cfg in fp8._prune(fp8._CONFIGS, {}, BM=128, BK=128):  # compiles what phase 2 autotunes over
        fp8.FORCE_CONFIG = (cfg.num_warps, fp8._maxnreg(cfg))
        q, s = tq.quantize(w)
        same_d = not dequant or bool(torch.equal(tq.dequantize(q_ref, s_ref), d_ref))
        cases.append({"case": f"throughput {m}x{k} bf16 config {fp8.FORCE_CONFIG}",
                      "quant": bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)),
                      "dequant": same_d})  # fmt: skip
    fp8.FORCE_CONFIG = None
    row: dict[str, Any] = {"variant": name, "check_s": time.time() - t0}
    row["quant_exact"] = all(c["quant"] for c in cases)
    row["dequant_exact"] = all(c["dequant"] for c in cases) if dequant else None
    row["exact"] = row["quant_exact"] and row["dequant_exact"]
    row["failed_cases"] = [c for c in cases if not (c["quant"] and c["dequant"])]
    row["n_cases"] = len(cases)
    return row


def throughput_weight() -> torch.Tensor:
    """The 16384 x 8192 bf16 throughput weight (seeded)."""
    gen = torch.Generator(device=_DEV).manual_seed(1)
    return torch.randn(*_THROUGHPUT, device=_DEV, generator=gen).to(torch.bfloat16)


def time_variant(name: str, copy_gbs: float) -> dict[str, Any]:
    """Phase 2 (child): autotuned throughput of one variant."""
    from underlay.ops.quant import quantize_fp8_blockwise

    fp8 = fp8_variants
    tq = fp8.VariantFp8Quantizer(device(), variant=name)
    t0 = time.time()
    m, k = _THROUGHPUT
    w = throughput_weight()
    q_ref, s_ref = quantize_fp8_blockwise(w)
    q, s = tq.quantize(w)  # autotunes (compiled in phase 1)
    same_q = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref))
    del q, s
    tq.dequantize(q_ref, s_ref)
    nbytes = m * k * 3 + s_ref.numel() * 4
    t_q = median_ms(lambda: tq.quantize(w))
    t_d = median_ms(lambda: tq.dequantize(q_ref, s_ref))
    return {
        "variant": name,
        # one call between the events (host launch time included, as the bench measured before 2026-12)
        "quant_ms_single": median_ms(lambda: tq.quantize(w), batch=1),
        "dequant_ms_single": median_ms(lambda: tq.dequantize(q_ref, s_ref), batch=1),
        "tuned_quant_identical": same_q,
        "quant_ms": t_q,
        "quant_gbs": nbytes / t_q / 1e6,
        "quant_frac_of_copy": nbytes / t_q / 1e6 / copy_gbs,
        "dequant_ms": t_d,
        "dequant_gbs": nbytes / t_d / 1e6,
        "dequant_frac_of_copy": nbytes / t_d / 1e6 / copy_gbs,
        "quant_config": best_config(fp8._quant_kernel),
        "dequant_config": best_config(fp8._dequant_kernel),
        "time_s": time.time() - t0,
    }


def child(phase: str, names: list[str], copy_gbs: float, deadline: float, dequant_skip: set[str]) -> None:
    """Run ``names`` one after the other (phase ``check`` or ``time``), one tagged JSON line each; exit
    3 after a CUDA error (the context may be unusable; the parent starts a fresh child)."""
    for name in names:
        if time.time() > deadline:
            print(_TAG + json.dumps({"variant": name, "error": "not run: time budget"}), flush=True)
            continue
        print(_TAG + json.dumps({"start": name}), flush=True)
        try:
            if phase == "check":
                row = check_variant(name, dequant=name not in dequant_skip)
            else:
                row = time_variant(name, copy_gbs)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            print(
                _TAG
                + json.dumps({"variant": name, "error": msg[-3000:], "tb": traceback.format_exc()[-3000:]}),
                flush=True,
            )
            if not _SMOKE and ("CUDA" in msg or "cuda" in msg or "illegal" in msg):
                sys.exit(3)
            continue
        print(_TAG + json.dumps(row), flush=True)


def _reader(stream: Any, out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


class _Child:
    """One child process running ``names`` in ``phase``; its tagged lines arrive on ``lines``."""

    def __init__(
        self, phase: str, names: list[str], copy_gbs: float, deadline: float, extra: list[str]
    ) -> None:
        cmd = [*_CHILD_CMD, "--child", phase, "--variants", ",".join(names), "--copy-gbs", str(copy_gbs),
               "--deadline", str(deadline), *extra]  # fmt: skip
        self.names = list(names)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errs: collections.deque[str] = collections.deque(maxlen=60)
        threading.Thread(target=_reader, args=(self.proc.stdout, self.lines), daemon=True).start()
        self.err_thread = threading.Thread(target=self._read_errs, daemon=True)
        self.err_thread.start()
        self.current: str | None = None
        self.progress = False

    def _read_errs(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.errs.append(line)

    def err_tail(self) -> str:
        self.err_thread.join(timeout=5)
        return "".join(self.errs)[-3000:]

    def poll(self, report: Callable[[dict[str, Any]], None]) -> bool:
        """Handle the lines that arrived; True once the child has exited (its leftovers reported)."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return False
            if line is None:
                break
            if not line.startswith(_TAG):
                continue
            msg = json.loads(line[len(_TAG) :])
            self.progress = True
            if "start" in msg:
                self.current = msg["start"]
                continue
            self.current = None
            if msg["variant"] in self.names:
                self.names.remove(msg["variant"])
            report(msg)
        rc = self.proc.wait()
        if self.current is not None:  # died inside this variant
            self.names.remove(self.current)
            report(
                {
                    "variant": self.current,
                    "error": f"child exited with {rc} inside this variant: {self.err_tail()}",
                }
            )
        elif self.names and not self.progress:  # died before starting any variant: do not retry forever
            tail = self.err_tail()
            for name in self.names:
                report({"variant": name, "error": f"child exited with {rc} before this variant: {tail}"})
            self.names = []
        return True


def run_phase(
    phase: str,
    names: list[str],
    jobs: int,
    copy_gbs: float,
    deadline: float,
    report: Callable[[dict[str, Any]], None],
    extra: list[str] | None = None,
) -> None:
    """Run ``names`` in ``phase`` with up to ``jobs`` children (one variant each when ``jobs`` > 1, else
    one child for all); a child that dies is replaced by one for the variants it had left. ``extra``:
    more command-line arguments for the children."""
    todo = list(names)
    running: list[_Child] = []
    while todo or running:
        while todo and len(running) < jobs and time.time() < deadline:
            batch = [todo.pop(0)] if jobs > 1 else [todo.pop(0) for _ in range(len(todo))]
            running.append(_Child(phase, batch, copy_gbs, deadline, extra or []))
        if todo and time.time() >= deadline and not running:
            for name in todo:
                report({"variant": name, "error": "not run: time budget"})
            todo = []
        for ch in list(running):
            if ch.poll(report):
                running.remove(ch)
                if ch.names:  # left over after a crash or an early exit: a fresh child carries on
                    todo = ch.names + todo
                    ch.names = []
            elif time.time() > deadline + 180:  # stuck well past the budget: stop it (we started it)
                ch.proc.kill()
        time.sleep(0.05)


def main() -> None:
    """Parent: baseline (copy bandwidth, torch quantiser, reference checks), then the variants in children."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=os.environ.get("FP8_VARIANTS", ""))
    ap.add_argument("--child", default="")
    ap.add_argument("--copy-gbs", type=float, default=0.0)
    ap.add_argument("--deadline", type=float, default=0.0)
    ap.add_argument("--dequant-skip", default="")
    args = ap.parse_args()
    if args.child:
        child(
            args.child,
            args.variants.split(","),
            args.copy_gbs,
            args.deadline,
            set(args.dequant_skip.split(",")),
        )
        return
    start = time.time()
    deadline = start + float(os.environ.get("FP8_BENCH_BUDGET_S", "480"))
    fp8 = fp8_variants
    if args.variants:
        names = [fp8.parse_variant(v).name for v in args.variants.split(",") if v.strip()]
    else:
        names = [v for v in _PRIORITY if v in fp8.VARIANTS] + [v for v in fp8.VARIANTS if v not in _PRIORITY]
    print(
        f"torch {torch.__version__} triton {fp8.triton.__version__} {gpu_name()}",
        flush=True,
    )
    dev = torch.device(_DEV)
    src = torch.empty(1 << (20 if _SMOKE else 29), device=dev, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), batch=3)
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    src = dst = torch.empty(0)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    m, k = _THROUGHPUT
    w = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    rq = quantizer("torch")
    q, s = rq.quantize(w)
    nbytes = m * k * 3 + s.numel() * 4
    t_q = median_ms(lambda: rq.quantize(w), reps=5, batch=2)
    t_d = median_ms(lambda: rq.dequantize(q, s), reps=5, batch=2)
    torch_row = {
        "quant_ms": t_q,
        "quant_gbs": nbytes / t_q / 1e6,
        "dequant_ms": t_d,
        "dequant_gbs": nbytes / t_d / 1e6,
    }
    print(f"torch quantiser: quantise {t_q:.3f} ms ({100 * nbytes / t_q / 1e6 / copy_gbs:.0f}% of copy); "
          f"dequantise {t_d:.3f} ms ({100 * nbytes / t_d / 1e6 / copy_gbs:.0f}%)", flush=True)  # fmt: skip
    # the library's kernel (underlay.backends.cuda.fp8, through the registry): exact on every case, timed
    lq = quantizer("triton")
    lib_cases = [
        compare(lq, sample(mm, kk, dt, block, seed=i), block) for i, (mm, kk, dt, block) in enumerate(_SHAPES)
    ]
    lib_cases.append(compare(lq, w, (128, 128)))
    lq.quantize(w)  # autotunes
    lq.dequantize(q, s)
    t_lq = median_ms(lambda: lq.quantize(w))
    t_ld = median_ms(lambda: lq.dequantize(q, s))
    library_row = {
        "exact": all(c["quant"] and c["dequant"] for c in lib_cases),
        "quant_ms": t_lq,
        "quant_frac_of_copy": nbytes / t_lq / 1e6 / copy_gbs,
        "dequant_ms": t_ld,
        "dequant_frac_of_copy": nbytes / t_ld / 1e6 / copy_gbs,
    }
    print(f"library triton quantiser ({type(lq).__module__}): exact {library_row['exact']} quantise "
          f"{t_lq:.3f} ms ({100 * library_row['quant_frac_of_copy']:.0f}% of copy); dequantise {t_ld:.3f} ms "
          f"({100 * library_row['dequant_frac_of_copy']:.0f}%)", flush=True)  # fmt: skip
    del w, q, s
    reference = []  # properties of the torch reference itself (same for every variant)
    for i, (mm, kk, dt, block) in enumerate(_SHAPES[:5]):
        w = sample(mm, kk, dt, block, seed=i)
        q, s = rq.quantize(w, block)
        d = rq.dequantize(q, s, block, torch.float32)
        scale = s.repeat_interleave(block[0], 0)[:mm].repeat_interleave(block[1], 1)[:, :kk]
        err = (d - w.float()).abs()
        bound = torch.maximum(w.float().abs() * 2.0**-4, scale * 2.0**-10) * 1.0001
        reference.append({"shape": [mm, kk], "dtype": str(dt), "block": list(block),
                          "zero_tile_scale_1": bool(s[0, 0] == 1.0),
                          "roundtrip_within_bound": bool((err <= bound).all()),
                          "max_rel_err_normals": float((err / w.float().abs().clamp(min=1e-30))[
                              w.float().abs() >= scale * 2.0**-6].max())})  # fmt: skip
    torch.cuda.empty_cache()
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": fp8.triton.__version__,
        "gpu": gpu_name(),
        "copy_gbs": copy_gbs,
        "throughput_shape": [m, k],
        "timing": "CUDA-event median of 10 back-to-back calls, per call, after autotuning",
        "torch_quantiser": torch_row,
        "library_quantiser": library_row,
        "reference": reference,
        "default_variant": fp8.DEFAULT_VARIANT,
        "variants": {},
    }
    out_path = os.path.join(os.environ.get("OUT", "."), "bench_fp8.json")

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(info, f, indent=1)

    checks: dict[str, dict[str, Any]] = {}
    info["checks"] = checks  # phase 1 rows (also for variants that never get timed)

    def report_check(row: dict[str, Any]) -> None:
        checks[row["variant"]] = row
        if "error" in row:
            info["variants"][row["variant"]] = row
            print(
                f"variant {row['variant']}: FAILED in the exactness phase: {row['error'][-1500:]}", flush=True
            )
        else:
            bad = [c["case"] for c in row["failed_cases"]]
            deq = "with its twin" if row["dequant_exact"] is None else row["dequant_exact"]
            print(f"checked {row['variant']}: quantise exact {row['quant_exact']}, dequantise exact {deq} "
                  f"({row['n_cases']} cases, {row['check_s']:.0f} s)" + (f" failed: {bad}" if bad else ""),
                  flush=True)  # fmt: skip
        save()

    def report_time(row: dict[str, Any]) -> None:
        row = {**checks.get(row["variant"], {}), **row}
        info["variants"][row["variant"]] = row
        if "error" in row:
            print(f"variant {row['variant']}: FAILED {row['error'][-1500:]}", flush=True)
        else:
            row["quant_exact"] = row["quant_exact"] and row["tuned_quant_identical"]
            row["exact"] = row["quant_exact"] and row["dequant_exact"]
            print(f"variant {row['variant']}: exact {row['exact']} quantise {row['quant_ms']:.3f} ms "
                  f"{row['quant_gbs']:.0f} GB/s ({100 * row['quant_frac_of_copy']:.0f}% of copy); dequantise "
                  f"{row['dequant_ms']:.3f} ms {row['dequant_gbs']:.0f} GB/s "
                  f"({100 * row['dequant_frac_of_copy']:.0f}% of copy) [quant {row['quant_config']}, dequant "
                  f"{row['dequant_config']}; one call alone {row['quant_ms_single']:.3f} / "
                  f"{row['dequant_ms_single']:.3f} ms]"
                  + ("" if row["exact"] else f" quant_exact={row['quant_exact']} dequant_exact="
                     f"{row['dequant_exact']}"),
                  flush=True)  # fmt: skip
        save()

    jobs = int(os.environ.get("FP8_BENCH_JOBS", str(min(8, max(1, (os.cpu_count() or 2) // 2)))))
    owners = {}  # dequant_key -> the variant whose child checks that dequantisation kernel
    for n in names:
        owners.setdefault(dequant_key(n), n)
    skip = [n for n in names if owners[dequant_key(n)] != n]
    run_phase("check", names, jobs, copy_gbs, deadline, report_check, ["--dequant-skip", ",".join(skip)])
    for n in skip:  # the shared dequantisation kernel was checked with its owner
        row, own = checks.get(n, {}), checks.get(owners[dequant_key(n)], {})
        if "error" not in row and row:
            row["dequant_exact"] = bool(own.get("dequant_exact", False))
            row["dequant_checked_with"] = owners[dequant_key(n)]
            row["exact"] = row["quant_exact"] and row["dequant_exact"]
    print(f"exactness phase done after {time.time() - start:.0f} s", flush=True)
    timed = [n for n in names if n in checks and "error" not in checks[n]]
    run_phase("time", timed, 1, copy_gbs, deadline, report_time)
    rows = [r for r in info["variants"].values() if "error" not in r and "quant_ms" in r]
    for kind in ("quant", "dequant"):
        exact = [r for r in rows if r[f"{kind}_exact"]]
        label = "quantise" if kind == "quant" else "dequantise"
        if exact:
            best = min(exact, key=lambda r: r[f"{kind}_ms"])
            info[f"fastest_exact_{kind}"] = best["variant"]
            print(f"fastest exact {label}: {best['variant']} {best[f'{kind}_ms']:.3f} ms "
                  f"({100 * best[f'{kind}_frac_of_copy']:.0f}% of copy)", flush=True)  # fmt: skip
        else:
            print(f"fastest exact {label}: none", flush=True)
    print(f"reference checks: {reference}", flush=True)
    print(f"total {time.time() - start:.0f} s", flush=True)
    save()


if __name__ == "__main__":
    main()
