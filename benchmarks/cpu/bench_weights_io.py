"""Weights in and out at disk speed: ``load_hf`` and ``export_hf`` GB/s of the fsdp2
weight loader against the raw file read (and write) speed of the same machine, in the same run.

    OMP_NUM_THREADS=1 python -m benchmarks.cpu.bench_weights_io --out /tmp/wio          # cpu, gloo, 2 ranks
    python -m benchmarks.cpu.bench_weights_io --out /tmp/wio --device cuda --world 1 --repeats 1  # GPU host

1. Writes a random Qwen2-shaped model (``--gb`` GB in bf16: Qwen2-1.5B's widths, hidden 1536, ffn 8960,
   12/2 heads, vocab 151936, tied embeddings, the layer count scaled to the size; 28 layers = 3.09 GB)
   as ``--file-mb`` safetensors shards with an index into ``OUT/model`` (kept for later runs with the
   same arguments).
2. Raw read: one process reads every file start to end with plain ``read`` calls into one reusable
   buffer. Raw write: one process writes the same number of bytes into a file and fsyncs it.
3. ``--world`` ranks (gloo on cpu, nccl on cuda, one device per rank) build the fsdp2 engine from the
   directory (a first, untimed load), then time, alternating, ``repeat`` times each: ``load_hf`` (reads
   split across ranks, broadcast in rounds) and the previous algorithm (every rank reads every tensor
   itself with ``safe_open``, one parameter at a time); then ``export_hf`` in bf16 with the writer
   thread and with ``export_buffer_bytes=0`` (the same files written by the gathering thread: the
   sequential order of work). A time is the slowest rank's; the best of the repeats is reported.

Page cache (``--cache``): ``warm`` (default) reads every file once before the first measurement, so
raw read, load and the old path all read from memory (what repeated loads on one node see; the model
must fit in free memory); ``cold`` asks the kernel to drop each file's cached pages
(``posix_fadvise(DONTNEED)``, no root needed) before every raw read and load, so all read from the
disk (a page another process maps stays cached, so treat cold figures as an upper bound on disk speed).

Link (``--world`` > 1): the broadcasts ``load_hf`` makes, alone: rounds of ``--bucket-mb`` in which each
rank broadcasts its share, 3 GiB in all; every byte loaded crosses it once, so it bounds ``load_hf``
from above as the raw read does.

Writes ``OUT/weights_io.json`` with GB/s (10^9 bytes of tensor data per second) and the ratios to the
raw read / write speeds and to the link. ``--tiny`` runs a 4-layer hidden-256 model (a few MB; the
CPU runner's smoke run). ``--verify`` checks that the exported files hold the source tensors bit for bit
and, at more than one rank, that rank 0 of ``load_hf`` read about 1/world of the bytes while the old
path read all of them; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import _harness as harness

QWEN2_WIDTHS: dict[str, int] = dict(hidden=1536, ffn=8960, heads=12, kv=2, vocab=151936)
TINY_WIDTHS: dict[str, int] = dict(hidden=256, ffn=512, heads=4, kv=2, vocab=4096)


def model_config(gb: float, tiny: bool) -> Any:
    """The Qwen2 config of about ``gb`` GB in bf16 (``tiny``: 4 small layers)."""
    from transformers import Qwen2Config

    w = TINY_WIDTHS if tiny else QWEN2_WIDTHS
    h, f, head_dim = w["hidden"], w["ffn"], w["hidden"] // w["heads"]
    kv = w["kv"] * head_dim
    per_layer = 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * f + 2 * h
    layers = 4 if tiny else max(1, round((gb * 1e9 / 2 - w["vocab"] * h - h) / per_layer))
    return Qwen2Config(
        vocab_size=w["vocab"],
        hidden_size=h,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def write_model(d: Path, cfg: Any, file_bytes: int) -> dict[str, Any]:
    """Random bf16 tensors with the HF names and shapes of ``cfg`` in shards of about ``file_bytes``."""
    from safetensors.torch import save_file

    stamp = {"config": cfg.to_dict(), "file_bytes": file_bytes}
    marker = d / "bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(stamp)):
        return stamp
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied: written once, as save_pretrained does
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.copy_(torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02))
        nbytes = t.numel() * 2
        if shards[-1] and size + nbytes > file_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * 2 for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg.save_pretrained(str(d))
    marker.write_text(json.dumps(stamp))
    return stamp


def files_of(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    """Ask the kernel to evict the files' clean cached pages (best effort)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path]) -> tuple[float, int]:
    """Seconds and bytes to read every file start to end with plain reads into one 64 MiB buffer."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return time.perf_counter() - t0, total


def raw_write(d: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (64 MiB writes of one buffer) into a fresh file and fsync it."""
    buf = os.urandom(1 << 20) * 64
    path = d / "raw_write.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(buf)[: min(left, len(buf))])
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def sequential_load(engine: Any, path: Path) -> int:
    """The previous ``load_hf``: every rank validates every header and reads every tensor itself
    (``safe_open``), one engine parameter at a time. Returns the bytes this rank read."""
    import contextlib

    from safetensors import safe_open

    from underlay.engines._hf_load import plan_load
    from underlay.utils.safe_files import read_safetensors_dir

    wmap = engine.weight_map
    plan = plan_load(wmap, read_safetensors_dir(path), path, True)
    nbytes = 0
    with contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for f in sorted({plan.where[s].file for s in plan.source.values()})
        }
        for rule in wmap.rules:
            tensors = {
                hf: handles[plan.where[plan.source[hf]].file].get_tensor(plan.source[hf])
                for hf in rule.hf_names
            }
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            engine.copy_full_parameter(rule.engine_name, rule.from_hf(tensors))
    return nbytes


def _slowest(seconds: float, device: Any) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Any, device: Any) -> float:
    import torch.distributed as dist

    from underlay.registry import get_device

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    get_device().synchronize()
    return _slowest(time.perf_counter() - t0, device)


def link_seconds(bucket: int, rounds: int, device: Any) -> list[float]:
    """The link alone, as ``load_hf`` uses it: ``rounds`` rounds in which every rank broadcasts its
    ``bucket / world`` bytes to the others (async, all owners at once). Returns the slowest rank's
    seconds for all rounds, best of 2. Empty with one rank (no link)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return []
    bufs = [torch.empty(bucket // world, dtype=torch.uint8, device=device) for _ in range(world)]

    def go() -> None:
        for _ in range(rounds):
            works = [dist.broadcast(b, src=r, async_op=True) for r, b in enumerate(bufs)]
            for w in works:
                assert w is not None
                w.wait()

    return [_timed(go, device) for _ in range(2)]


def rank_main(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    import underlay
    from underlay.engines.fsdp2.weights import FSDP2WeightLoader
    from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig
    from underlay.parallel.agree import collective_device
    from underlay.parallel.distributed import init_distributed

    dev = underlay.get_device(args.device)
    init_distributed(dev)
    cdev = collective_device()
    out = Path(args.out)
    model = out / "model"
    files = files_of(model)
    t0 = time.perf_counter()
    engine = underlay.get_engine(
        EngineConfig(model=ModelConfig(path=str(model)), optim=OptimConfig(lr=1e-5), param_dtype="bfloat16")
    )
    res: dict[str, Any] = {"build_s": _slowest(time.perf_counter() - t0, cdev)}
    res["link_s"] = link_seconds(
        args.bucket_mb << 20, max(1, round(3 * 2**30 / (args.bucket_mb << 20))), cdev
    )
    loader = FSDP2WeightLoader(load_bucket_bytes=args.bucket_mb << 20)
    loads: dict[str, list[float]] = {"load_hf": [], "old_sequential_load": []}
    read: dict[str, int] = {}

    def load_new() -> None:
        read["load_hf"] = loader.load_hf(engine, model).bytes_read

    def load_old() -> None:
        read["old_sequential_load"] = sequential_load(engine, model)

    for _ in range(args.repeats):
        for label, fn in (("load_hf", load_new), ("old_sequential_load", load_old)):
            if args.cache == "cold" and rank == 0:
                drop_cache(files)
            loads[label].append(_timed(fn, cdev))
    res.update({f"{k}_s": v for k, v in loads.items()})
    res["bytes_read_rank"] = read
    exports: dict[str, list[float]] = {"export_hf": [], "sequential_export": []}
    shard_bytes = args.file_mb << 20

    def export(label: str) -> None:
        exp = FSDP2WeightLoader(export_buffer_bytes=1 << 30 if label == "export_hf" else 0)
        exp.export_hf(engine, out / f"export_{label}", dtype=torch.bfloat16, max_shard_bytes=shard_bytes)

    for _ in range(args.repeats):
        for label in exports:
            exports[label].append(_timed(lambda label=label: export(label), cdev))  # type: ignore[misc]
    res.update({f"{k}_s": v for k, v in exports.items()})
    if rank == 0 and args.verify:
        from safetensors.torch import load_file

        src: dict[str, torch.Tensor] = {}
        for f in files:
            src.update(load_file(str(f)))
        for label in exports:
            got: dict[str, torch.Tensor] = {}
            for f in files_of(out / f"export_{label}"):
                got.update(load_file(str(f)))
            res[f"{label}_bit_equal"] = got.keys() == src.keys() and all(
                torch.equal(got[k], src[k]) for k in src
            )
    for label in exports:
        if rank == 0:
            shutil.rmtree(out / f"export_{label}", ignore_errors=True)
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--gb", type=float, default=3.0, help="model size in GB of bf16 tensors")
    ap.add_argument("--world", type=int, default=2, help="ranks (cuda: one GPU each)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--file-mb", type=int, default=512, help="safetensors shard size, MiB")
    ap.add_argument("--bucket-mb", type=int, default=256, help="load_hf round size, MiB")
    ap.add_argument("--cache", default="warm", choices=("warm", "cold"))
    ap.set_defaults(repeats=2)
    ap.add_argument("--tiny", action="store_true", help="a few-MB model (tests)")
    ap.add_argument("--verify", action="store_true", help="check the exports equal the source bit for bit")
    args = ap.parse_args(argv)
    out = harness.out_dir(args)
    cfg = model_config(args.gb, args.tiny)
    t0 = time.perf_counter()
    write_model(out / "model", cfg, args.file_mb << 20)
    write_s = time.perf_counter() - t0
    files = files_of(out / "model")
    if args.cache == "warm":
        raw_read(files)
    else:
        drop_cache(files)
    read_s, file_bytes = raw_read(files)
    tensor_bytes = sum(
        int(v["data_offsets"][1]) - int(v["data_offsets"][0])
        for f in files
        for k, v in json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")]).items()
        if k != "__metadata__"
    )
    write_raw_s = raw_write(out, file_bytes)

    import torch.multiprocessing as mp

    from underlay.parallel.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        rank_main, args=(args, free_port(), queue), nprocs=args.world, join=True, start_method="spawn"
    )
    res = queue.get()
    gbps = lambda s: tensor_bytes / s / 1e9  # noqa: E731
    raw_gbps = file_bytes / read_s / 1e9
    write_gbps = file_bytes / write_raw_s / 1e9
    report: dict[str, Any] = {
        "device": args.device,
        "world": args.world,
        "cache": args.cache,
        "layers": cfg.num_hidden_layers,
        "files": len(files),
        "tensor_gb": round(tensor_bytes / 1e9, 3),
        "tensor_bytes": tensor_bytes,
        "model_write_s": round(write_s, 1),
        "raw_read_gbps": round(raw_gbps, 3),
        "raw_write_fsync_gbps": round(write_gbps, 3),
        "engine_build_s": round(res["build_s"], 2),
        "rank0_tensor_bytes_read": res["bytes_read_rank"],
    }
    for label in ("load_hf", "old_sequential_load", "export_hf", "sequential_export"):
        best = min(res[f"{label}_s"])
        base = raw_gbps if "load" in label else write_gbps
        report[label] = {
            "seconds": [round(s, 3) for s in res[f"{label}_s"]],
            "gbps": round(gbps(best), 3),
            f"ratio_to_raw_{'read' if 'load' in label else 'write'}": round(gbps(best) / base, 3),
        }
        if f"{label}_bit_equal" in res:
            report[label]["bit_equal_to_source"] = res[f"{label}_bit_equal"]
    if res["link_s"]:
        link_bytes = (
            (args.bucket_mb << 20)
            // args.world
            * args.world
            * max(1, round(3 * 2**30 / (args.bucket_mb << 20)))
        )
        link_gbps = link_bytes / min(res["link_s"]) / 1e9
        report["link_broadcast_gbps"] = round(link_gbps, 3)
        report["load_hf"]["ratio_to_link"] = round(gbps(min(res["load_hf_s"])) / link_gbps, 3)
    report["load_speedup_vs_old"] = round(min(res["old_sequential_load_s"]) / min(res["load_hf_s"]), 3)
    report["export_speedup_vs_sequential"] = round(
        min(res["sequential_export_s"]) / min(res["export_hf_s"]), 3
    )
    ok = True
    if args.verify:
        ok = all(report[k].get("bit_equal_to_source", False) for k in ("export_hf", "sequential_export"))
        read = report["rank0_tensor_bytes_read"]
        if args.world > 1:
            ok &= read["old_sequential_load"] == tensor_bytes
            ok &= abs(read["load_hf"] - tensor_bytes / args.world) < 0.1 * tensor_bytes
        report["verified"] = ok
    summary = (
        f"{report['tensor_gb']} GB, {args.world} rank(s): load_hf {report['load_hf']['gbps']} GB/s "
        f"({report['load_hf']['ratio_to_raw_read']} of raw read, {report['load_speedup_vs_old']}x the "
        f"sequential load); export_hf {report['export_hf']['gbps']} GB/s "
        f"({report['export_hf']['ratio_to_raw_write']} of raw write)"
        + (f"; verified {ok}" if args.verify else "")
    )
    harness.report("weights_io", report, summary, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
