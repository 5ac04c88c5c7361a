"""Weight sync for real: 2 gloo trainer ranks (fsdp2 engine, tiny random Llama with LoRA) and a receiver
process outside the trainer's default group.

- disaggregated: a stateless gloo group of its own; after several training steps the receiver's
  transformers model equals ``export_hf`` bit for bit; LoRA adapters alone equal ``export_adapters``
  (and load with peft); FP8 equals the registered ``Fp8Quantizer`` applied to the exported weights; an
  out-of-order version is refused and the receiver keeps its weights.
- colocated cpu: two reusable shared-memory buckets into an ``HFRolloutWorker`` process; a trainer killed
  in the middle of a sync leaves the worker on its previous version.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import START_METHOD, free_port, run_distributed
from tests.distributed import _fsdp_helpers as H
from underlay.interfaces import LoraConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
FP8_BLOCK = (16, 16)
TRAIN_STEPS = 3


def _train_step(engine: Any, rank: int, world: int, seed: int) -> None:
    engine.forward_backward(H.shard(H.global_batch(seed), rank, world), H.pg_loss)
    engine.optimizer_step()


# ------------------------------------------------------------------------------- disaggregated


def _receiver(port: int, out: str, queue: Any) -> None:
    """The inference side: a transformers model updated through a stateless gloo group."""
    torch.set_num_threads(1)
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        from underlay.registry import get_device
        from underlay.rollout import AdapterDirSink, ModuleSink, StagingSink, WeightReceiver, WeightSyncError

        model = AutoModelForCausalLM.from_config(H.llama_config(), dtype=torch.float32).eval()
        sink = ModuleSink(model)
        recv = WeightReceiver.disaggregated(
            get_device("cpu"), ("127.0.0.1", port), rank=1, num_receivers=1, timeout_s=180
        )
        log: list[Any] = []

        def snapshot(name: str) -> None:
            state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            save_file(state, str(Path(out) / name))

        for _ in range(TRAIN_STEPS):
            v = recv.receive(sink)
            snapshot(f"recv_full_v{v}.safetensors")
            log.append(("full", v))
        adapters = AdapterDirSink(Path(out) / "recv_adapters")
        log.append(("lora", recv.receive(adapters), str(adapters.path)))
        fp8 = StagingSink()
        v = recv.receive(fp8)
        save_file(
            {k: t.contiguous() for k, t in fp8.tensors.items()}, str(Path(out) / "recv_fp8.safetensors")
        )
        (Path(out) / "recv_fp8_header.json").write_text(json.dumps(dict(fp8.header)))
        log.append(("fp8", v))
        try:
            recv.receive(sink)
            log.append(("stale", "accepted"))
        except WeightSyncError as exc:
            log.append(("stale", str(exc)))
        snapshot("recv_after_stale.safetensors")
        log.append(("version", recv.version))
        recv.close()
        queue.put(("ok", log))
    except BaseException:
        queue.put(("err", traceback.format_exc()))


def _trainer(rank: int, world: int, port: int, out: str) -> dict[str, Any]:
    import underlay
    from underlay.rollout import WeightPayload, WeightSender, WeightSyncError

    engine = underlay.get_engine(H.engine_config(H.llama_config(), lora=LORA))
    loader = underlay.get_weight_loader()
    sender = (
        WeightSender.disaggregated(
            engine.device, ("127.0.0.1", port), num_receivers=1, bucket_bytes=6000, timeout_s=180
        )
        if rank == 0
        else WeightSender.follower(bucket_bytes=6000)
    )
    reports = []
    for step in range(1, TRAIN_STEPS + 1):
        _train_step(engine, rank, world, seed=step)
        reports.append(sender.sync(engine, version=step))
        loader.export_hf(engine, Path(out) / f"export_v{step}")
    reports.append(sender.sync(engine, WeightPayload("lora")))
    loader.export_adapters(engine, Path(out) / "export_adapters")
    reports.append(sender.sync(engine, WeightPayload(fp8_block=FP8_BLOCK)))
    stale = "no error"
    try:
        sender.sync(engine, version=2)
    except WeightSyncError as exc:
        stale = str(exc)
    sender.close()
    return {"reports": [(r.version, r.buckets, r.tensors, r.nbytes) for r in reports], "stale": stale}


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    """Start ``target(*args, queue)`` in a process of its own, as the trainer ranks start (forked from
    the forkserver that already imported torch and transformers; a fresh interpreter on a CUDA host):
    a fresh interpreter would import them again, several CPU seconds per receiver."""
    ctx = multiprocessing.get_context(START_METHOD)
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    return proc, queue


def _result(proc: Any, queue: Any) -> Any:
    proc.join(timeout=240)
    assert not queue.empty(), f"receiver process exited ({proc.exitcode}) without a result"
    status, payload = queue.get()
    assert status == "ok", payload
    return payload


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("weight_sync")
    port = free_port()
    proc, queue = _spawn(_receiver, port, str(out))
    trainers = run_distributed(_trainer, 2, port, str(out), timeout_s=240)
    return {"out": out, "trainers": trainers, "receiver": _result(proc, queue)}


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{k} differs"


def test_receiver_equals_export_after_every_sync(disagg: dict[str, Any]) -> None:
    out = disagg["out"]
    assert [e[:2] for e in disagg["receiver"][:TRAIN_STEPS]] == [("full", v) for v in (1, 2, 3)]
    exports = [_load(out / f"export_v{v}" / "model.safetensors") for v in (1, 2, 3)]
    for v, ref in zip((1, 2, 3), exports):
        _assert_bit_equal(_load(out / f"recv_full_v{v}.safetensors"), ref)
    # the syncs carried training: every version differs from the previous one (merged LoRA deltas)
    assert not torch.equal(
        exports[0]["model.layers.0.self_attn.q_proj.weight"],
        exports[2]["model.layers.0.self_attn.q_proj.weight"],
    )
    rank0, rank1 = disagg["trainers"]
    assert all(r[1] > 1 for r in rank0["reports"][:TRAIN_STEPS])  # several buckets per sync
    assert all(r[3] == 0 for r in rank1["reports"])  # the follower iterates, sends nothing


def test_lora_adapters_alone_in_peft_format(disagg: dict[str, Any]) -> None:
    out = disagg["out"]
    kind, version, path = disagg["receiver"][TRAIN_STEPS]
    assert (kind, version) == ("lora", TRAIN_STEPS + 1)
    got = _load(Path(path) / "adapter_model.safetensors")
    ref = _load(out / "export_adapters" / "adapter_model.safetensors")
    _assert_bit_equal(got, ref)
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in got)
    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    ref_cfg = json.loads((out / "export_adapters" / "adapter_config.json").read_text())
    for key in ("peft_type", "r", "lora_alpha", "bias"):
        assert cfg[key] == ref_cfg[key], key
    assert sorted(cfg["target_modules"]) == sorted(ref_cfg["target_modules"])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(H.llama_config(), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, path)
    live = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(live) == len(got)
    for k, t in got.items():
        assert torch.equal(live[k.replace(".weight", ".default.weight")], t)


def test_fp8_equals_quantizer_output(disagg: dict[str, Any]) -> None:
    import underlay
    from underlay.rollout.payload import default_fp8_filter, scale_name

    out = disagg["out"]
    assert disagg["receiver"][TRAIN_STEPS + 1] == ("fp8", TRAIN_STEPS + 2)
    header = json.loads((out / "recv_fp8_header.json").read_text())
    assert header["fp8"] == {"block": list(FP8_BLOCK)}
    got = _load(out / "recv_fp8.safetensors")
    ref = _load(out / f"export_v{TRAIN_STEPS}" / "model.safetensors")
    quantizer = underlay.get_quantizer()
    expected: dict[str, torch.Tensor] = {}
    for name, t in ref.items():
        if default_fp8_filter(name, t):
            q, s = quantizer.quantize(t, FP8_BLOCK)
            expected[name], expected[scale_name(name)] = q, s
        else:
            expected[name] = t
    assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" in got
    _assert_bit_equal(got, expected)


def test_stale_version_refused_and_weights_kept(disagg: dict[str, Any]) -> None:
    out = disagg["out"]
    log = disagg["receiver"]
    assert log[-2][0] == "stale" and "not newer" in log[-2][1]
    assert log[-1] == ("version", TRAIN_STEPS + 2)
    _assert_bit_equal(
        _load(out / "recv_after_stale.safetensors"),
        _load(out / f"export_v{TRAIN_STEPS}" / "model.safetensors"),
    )
    assert "not applied" in disagg["trainers"][0]["stale"]


# ---------------------------------------------------------------------------- colocated (cpu)


def _colocated_trainer(rank: int, world: int, out: str) -> dict[str, Any]:
    import underlay
    from underlay.rollout import HFRolloutWorker, WeightSender
    from underlay.rollout.codec import tensor_digest

    engine = underlay.get_engine(H.engine_config(H.llama_config()))
    sender = WeightSender.colocated(engine.device, bucket_bytes=5000, timeout_s=120, wait=False)
    worker = HFRolloutWorker(
        H.llama_config(), dtype=torch.float32, device="cpu", port=sender.port, timeout_s=120
    )
    sender.wait_for_receivers()
    worker.wait_ready()
    loader = underlay.get_weight_loader()
    result: dict[str, Any] = {"reports": []}
    for step in (1, 2):
        _train_step(engine, rank, world, seed=10 + step)
        worker.start_receive()
        report = sender.sync(engine)
        result["reports"].append((report.version, report.buckets, report.buffer_bytes, report.nbytes))
        result[f"worker_v{step}"] = worker.finish_receive()
        loader.export_hf(engine, Path(out) / f"colo_export_v{step}")
        state = worker.state_dict()
        ref = _load(Path(out) / f"colo_export_v{step}" / "model.safetensors")
        result[f"equal_v{step}"] = sorted(state) == sorted(ref) and all(
            torch.equal(state[k], ref[k]) for k in ref
        )
        result[f"digest_v{step}"] = worker.state_digest() == {k: tensor_digest(v) for k, v in ref.items()}
    worker.close()
    sender.close()
    return result


def _survivor(out: str, queue: Any) -> None:
    """A receiver whose trainer is killed mid-sync: it must stay on version 1 with v1's weights."""
    torch.set_num_threads(1)
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        from underlay.registry import get_device
        from underlay.rollout import ModuleSink, WeightReceiver, WeightSyncError

        port = int((Path(out) / "port").read_text()) if (Path(out) / "port").exists() else 0
        model = AutoModelForCausalLM.from_config(H.llama_config(), dtype=torch.float32).eval()
        sink = ModuleSink(model)
        recv = WeightReceiver.colocated(get_device("cpu"), ("127.0.0.1", port), timeout_s=120)
        first = recv.receive(sink)
        try:
            recv.receive(sink)
            second = "accepted"
        except WeightSyncError as exc:
            second = str(exc)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(Path(out) / "survivor.safetensors"))
        queue.put(("ok", (first, second, recv.version)))
    except BaseException:
        queue.put(("err", traceback.format_exc()))


def _killed_trainer(rank: int, world: int, out: str, port: int) -> None:
    import underlay
    from underlay.rollout import WeightSender
    from underlay.rollout.payload import WeightPayload, payload_buckets

    engine = underlay.get_engine(H.engine_config(H.llama_config()))
    sender = WeightSender.colocated(engine.device, ("127.0.0.1", port), bucket_bytes=5000, timeout_s=120)
    _train_step(engine, rank, world, seed=21)
    sender.sync(engine)
    underlay.get_weight_loader().export_hf(engine, Path(out) / "killed_export_v1")
    _train_step(engine, rank, world, seed=22)

    def dying() -> Any:
        for i, bucket in enumerate(payload_buckets(engine, WeightPayload(), 5000)):
            if i == 2:  # the trainer process dies mid-sync, after two buckets reached the receiver
                os._exit(3)
            yield bucket

    sender.send(dying(), {"payload": "full"})


def test_colocated_shared_memory_worker(tmp_path: Path) -> None:
    (res,) = run_distributed(_colocated_trainer, 1, str(tmp_path), timeout_s=240)
    assert res["worker_v1"] == 1 and res["worker_v2"] == 2
    assert res["equal_v1"] and res["equal_v2"]
    assert res["digest_v1"] and res["digest_v2"]  # the worker's digests name the same bits
    for _version, buckets, buffer_bytes, nbytes in res["reports"]:
        assert buckets > 1
        # two reusable bucket buffers: far less than the model
        assert 0 < buffer_bytes < nbytes
    assert not any(p.name.startswith("underlay_weight_sync_") for p in Path("/dev/shm").glob("*"))


def test_killed_sender_leaves_previous_version(tmp_path: Path) -> None:
    from tests._dist import ChildFailure

    port = free_port()
    (tmp_path / "port").write_text(str(port))
    proc, queue = _spawn(_survivor, str(tmp_path))
    with pytest.raises(ChildFailure):
        run_distributed(_killed_trainer, 1, str(tmp_path), port, timeout_s=240)
    first, second, version = _result(proc, queue)
    assert first == 1 and version == 1
    assert "broke off" in second
    _assert_bit_equal(
        _load(tmp_path / "survivor.safetensors"), _load(tmp_path / "killed_export_v1" / "model.safetensors")
    )
