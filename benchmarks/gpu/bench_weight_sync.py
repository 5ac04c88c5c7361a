"""Rollout weight sync: fsdp2 engine -> a transformers model in another process (issue 35, goal 7).

One trainer rank builds the fsdp2 engine (Qwen3-4B shape by default: 4.02 B parameters, bf16 on an
accelerator = 8.0 GB; random init; ``--size qwen2-1.5b`` the earlier 3.1 GB record) and an
``HFRolloutWorker`` process holding the same model. Each timed sync streams ``engine.iter_weights``
through a ``WeightSender`` into the worker's ``ModuleSink`` (staged, then swapped in) and ends when the
worker acknowledged the commit.

- ``--mode colocated`` (default): the worker shares the trainer's device; ``--buffers`` reusable bucket
  buffers used in turn (CUDA IPC on cuda, shared memory on cpu; default 2: the worker copies one
  bucket out while the engine gathers the next). Goal on the H200: sync <= 2x ``iter_weights`` alone.
- ``--mode disaggregated``: the worker joins a broadcast group of its own (nccl on cuda, needs two GPUs:
  the worker runs on device 1; gloo on cpu: the CPU record's command below).

Baseline in the same run: the engine's own ``iter_weights`` pass (gather + cast, no transport), timed
in interleaved rounds with the sync (round = one ``iter_weights`` pass, then one sync; one warm-up
round, then ``--repeats`` rounds): the figure is median sync / median ``iter_weights`` (goal <= 2.0),
with every round's ratio. Also reported: sync GB/s and the device copy bandwidth (``dst.copy_(src)`` of
the same byte count; a sync copies every byte at least twice: into the bucket buffer and out of it into
the staging buffer). Every synced state is checked bit-equal to the engine's weights after the last sync.

    python -m benchmarks.gpu.bench_weight_sync [--out DIR]                  # H200: Qwen3-4B shape
    python -m benchmarks.gpu.bench_weight_sync --repeats 3                    # run.sh --fast
    python -m benchmarks.gpu.bench_weight_sync --mode disaggregated           # 2 GPUs
    OMP_NUM_THREADS=1 python -m benchmarks.gpu.bench_weight_sync --device cpu --mode disaggregated \
        --size small --bucket-mb 64                                           # the CPU (gloo) figure
    python -m benchmarks.gpu.bench_weight_sync --device cpu --size tiny       # dry run

Writes ``OUT/weight_sync_<mode>_<device>.json``; exit status 1 when the synced state is not bit-exact.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks import _harness as harness
from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig


def model_config(size: str) -> Any:
    """Random-init configs: ``qwen3-4b`` (the goal's shape), ``qwen2-1.5b`` (the earlier record),
    ``small`` (~75 M, the cpu figure), ``tiny`` (dry run)."""
    from transformers import Qwen2Config, Qwen3Config

    if size == "qwen3-4b":
        return Qwen3Config(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
            tie_word_embeddings=True,
        )  # fmt: skip
    shapes = {
        "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2),
        "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=6,
                      num_attention_heads=12, num_key_value_heads=2),
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2),
    }  # fmt: skip
    return Qwen2Config(**shapes[size], max_position_embeddings=4096, tie_word_embeddings=True)


def copy_bandwidth(device: Any, nbytes: int, reps: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` for ``nbytes`` bytes on the device (median over ``reps``)."""
    tdev = device.torch_device() if device.is_accelerator else torch.device("cpu")
    pair = [torch.empty(nbytes, dtype=torch.uint8, device=tdev).random_(0, 255)]
    pair.append(torch.empty_like(pair[0]))
    median = harness.timeit(lambda: pair[1].copy_(pair[0]), warmup=1, repeats=reps, device=tdev).median
    pair.clear()
    device.empty_cache()
    return nbytes / median / 1e9


def iter_weights_pass(engine: Any, bucket_bytes: int) -> tuple[float, int]:
    """Wall seconds of one pass over ``engine.iter_weights`` (no transport; the device synchronised
    before and after), and the bytes it yielded."""
    engine.device.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    for bucket in engine.iter_weights(bucket_bytes):
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    engine.device.synchronize()
    return time.perf_counter() - t0, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated")
    ap.add_argument("--size", choices=("qwen3-4b", "qwen2-1.5b", "small", "tiny"), default="qwen3-4b")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size in MiB")
    ap.add_argument("--buffers", type=int, default=2, help="colocated: bucket buffers used in turn")
    ap.add_argument(
        "--goal", type=float, default=2.0, help="colocated goal: sync / iter_weights at most this"
    )
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.buffers < 1:
        ap.error(f"--repeats {args.repeats} and --buffers {args.buffers} must be >= 1")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    import underlay
    from underlay.parallel.distributed import init_distributed
    from underlay.rollout import HFRolloutWorker, WeightSender
    from underlay.rollout.codec import tensor_digest

    device = underlay.get_device(args.device)
    accel = device.is_accelerator
    if args.mode == "disaggregated" and accel and device.device_count() < 2:
        print(f"disaggregated mode on {device.name} needs two devices (the NCCL family refuses two ranks "
              f"on one device); {device.device_count()} visible", file=sys.stderr)  # fmt: skip
        return 2
    init_distributed(device)
    hf_config = model_config(args.size)
    dtype = torch.bfloat16 if accel else torch.float32
    engine = underlay.get_engine(
        EngineConfig(
            model=ModelConfig(hf_config=hf_config, seed=0),
            optim=OptimConfig(lr=1e-5),
            param_dtype="bfloat16" if accel else "float32",
        )
    )
    bucket = args.bucket_mb << 20
    if args.mode == "colocated":
        sender = WeightSender.colocated(
            device, bucket_bytes=bucket, timeout_s=600, wait=False, buffers=args.buffers
        )
        worker_index = device.current_index() if accel else None
    else:
        sender = None
        worker_index = 1 if accel else None
    from underlay.parallel.distributed import free_port

    port = sender.port if sender is not None else free_port()
    worker = HFRolloutWorker(
        hf_config,
        dtype=dtype,
        device=device.name,
        device_index=worker_index,
        port=port,
        mode=args.mode,
        timeout_s=600,
        threads=max(1, torch.get_num_threads()),
    )
    if sender is None:
        sender = WeightSender.disaggregated(device, ("127.0.0.1", port), bucket_bytes=bucket, timeout_s=600)
    else:
        worker.wait_ready()  # colocated: the worker connects without waiting for the sender
        sender.wait_for_receivers()
    worker.wait_ready()

    seconds: list[float] = []
    iter_s: list[float] = []
    report = None
    total = 0
    for i in range(args.repeats + 1):  # round 0 warms up (allocates the buffers, maps them)
        t_iter, total = iter_weights_pass(engine, bucket)
        worker.start_receive()
        report = sender.sync(engine)
        worker.finish_receive()
        if i > 0:
            iter_s.append(t_iter)
            seconds.append(report.seconds)
    assert report is not None
    # bit-exactness by SHA-256 of every tensor (an 8 GB state dict is not shipped out of the worker)
    engine_digest: dict[str, str] = {}
    parameters = 0
    for b in engine.iter_weights(bucket):
        for n, t in b:
            engine_digest[n] = tensor_digest(t)
            parameters += t.numel()
    got = worker.state_digest()
    exact = set(got) >= set(engine_digest) and all(got[n] == d for n, d in engine_digest.items())
    copy_gbs = copy_bandwidth(device, report.nbytes)
    sync_s = statistics.median(seconds)
    t_iter = statistics.median(iter_s)
    sync_gbs = report.nbytes / sync_s / 1e9
    ratio_iter = sync_s / t_iter
    rounds = [s / t for s, t in zip(seconds, iter_s)]
    worker.close()
    sender.close()
    result = {
        "what": "rollout weight sync, fsdp2 engine -> HFRolloutWorker process (ModuleSink)",
        "mode": args.mode,
        "device": device.name,
        "device_model": device.model_name(),
        "size": args.size,
        "parameters": parameters,
        "bytes": report.nbytes,
        "tensors": report.tensors,
        "buckets": report.buckets,
        "bucket_bytes": bucket,
        "buffers": args.buffers if args.mode == "colocated" else None,
        "transport_buffer_bytes": report.buffer_bytes,
        "sync_seconds_median": sync_s,
        "sync_seconds_all": seconds,
        "sync_GBps": sync_gbs,
        "iter_weights_seconds": t_iter,
        "iter_weights_seconds_all": iter_s,
        "iter_weights_GBps": total / t_iter / 1e9,
        "ratio_sync_to_iter_weights": ratio_iter,
        "ratio_sync_to_iter_weights_rounds": rounds,
        "goal": f"sync <= {args.goal}x iter_weights",
        "goal_met": ratio_iter <= args.goal,
        "copy_GBps": copy_gbs,
        "ratio_sync_to_copy": harness.ratio(sync_gbs, copy_gbs),
        "seconds_for_3GB": sync_s * 3e9 / report.nbytes,
        "bit_exact": exact,
    }
    summary = (
        f"{args.mode} {device.name} {args.size}: {report.nbytes / 1e9:.3f} GB in {report.buckets} buckets, "
        f"sync {sync_s * 1e3:.1f} ms = {ratio_iter:.2f}x iter_weights alone ({t_iter * 1e3:.1f} ms; rounds "
        f"{min(rounds):.2f}-{max(rounds):.2f}; goal <= {args.goal}: {'met' if ratio_iter <= args.goal else 'NOT met'}); "
        f"{sync_gbs:.1f} GB/s = {result['ratio_sync_to_copy']:.3f} of the device copy ({copy_gbs:.0f} GB/s); "
        f"bit-exact {exact}"
    )
    harness.report(f"weight_sync_{args.mode}_{device.name}", result, summary, harness.out_dir(args))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
