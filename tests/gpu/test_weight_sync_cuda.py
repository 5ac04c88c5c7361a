"""Colocated weight sync over a CUDA IPC bucket: fsdp2 engine -> HFRolloutWorker process, bit-exact.

A bf16 tiny Qwen2 engine (about 0.2 MB) streams its weights in 32 KiB buckets (several per sync, so both
IPC buffers are used in turn) three times (a step between the syncs changes them); after each, the
worker's state equals the engine's bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_distributed

pytestmark = pytest.mark.gpu


def job_colocated_cuda(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 of ``run_distributed``: engine, worker and three syncs; returns what the test checks."""
    from transformers import Qwen2Config

    import underlay
    from underlay.interfaces import EngineConfig, ModelConfig, OptimConfig
    from underlay.rollout import HFRolloutWorker, WeightSender

    hf = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    device = underlay.get_device("cuda")
    engine = underlay.get_engine(
        EngineConfig(
            model=ModelConfig(hf_config=hf, seed=0), optim=OptimConfig(lr=1e-2), param_dtype="bfloat16"
        )
    )
    bucket = 1 << 15
    sender = WeightSender.colocated(device, bucket_bytes=bucket, timeout_s=300, wait=False)
    worker = HFRolloutWorker(
        hf, dtype=torch.bfloat16, device="cuda", device_index=device.current_index(), port=sender.port,
        mode="colocated", timeout_s=300,
    )  # fmt: skip
    worker.wait_ready()
    sender.wait_for_receivers()
    exact, buckets = [], []
    try:
        for i in range(3):
            if i:
                with torch.no_grad():
                    for p in engine.model.parameters():
                        p.add_(0.01 * i)
            worker.start_receive()
            report = sender.sync(engine)
            worker.finish_receive()
            state = {n: t.cpu() for b in engine.iter_weights(bucket) for n, t in b}
            got = worker.state_dict()
            exact.append(
                set(got) >= set(state) and all(torch.equal(got[n].cpu(), t) for n, t in state.items())
            )
            buckets.append(report.buckets)
    finally:
        worker.close()
        sender.close()
    return {"exact": exact, "buckets": buckets}


def test_colocated_cuda_ipc_sync_is_bit_exact() -> None:
    (res,) = run_distributed(job_colocated_cuda, 1, backend="nccl", timeout_s=300)
    assert res["exact"] == [True, True, True], res
    assert all(b >= 3 for b in res["buckets"]), res
