"""The weight-sync protocol in one process (sender and receiver on two threads, real TCPStore and
shared-memory bucket): aborts, refusals, sink errors and buffer growth keep the receiver consistent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._dist import free_port
from underlay.interfaces import ConfigError, InvalidInput
from underlay.registry import get_device
from underlay.rollout import StagingSink, WeightReceiver, WeightSender, WeightSyncError


class _Run:
    """``receiver.receive(sink)`` on a thread; ``result()`` returns the version or the exception."""

    def __init__(self, receiver: WeightReceiver, sink: Any) -> None:
        self.out: Any = None
        self._t = threading.Thread(target=self._go, args=(receiver, sink), daemon=True)
        self._t.start()

    def _go(self, receiver: WeightReceiver, sink: Any) -> None:
        try:
            self.out = receiver.receive(sink)
        except Exception as exc:
            self.out = exc

    def result(self) -> Any:
        self._t.join(timeout=60)
        assert not self._t.is_alive()
        return self.out


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(30, 20, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(64, 64, generator=g),
    }


def _buckets(
    w: dict[str, torch.Tensor], fail_after: int | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    for i, (name, t) in enumerate(w.items()):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("engine failed mid-sync")
        yield [(name, t)]


@pytest.fixture(params=[1, 2], ids=["1buffer", "2buffers"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[WeightSender, WeightReceiver, int]]:
    dev = get_device("cpu")
    sender = WeightSender.colocated(dev, bucket_bytes=1024, timeout_s=30, wait=False, buffers=request.param)
    receiver = WeightReceiver.colocated(dev, ("127.0.0.1", sender.port), timeout_s=30)
    sender.wait_for_receivers()
    yield sender, receiver, request.param
    receiver.close()
    sender.close()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_protocol_edge_cases(pair: tuple[WeightSender, WeightReceiver, int]) -> None:
    sender, receiver, buffers = pair
    sink = StagingSink()
    w1, w2, w3 = _weights(1), _weights(2), _weights(3)

    run = _Run(receiver, sink)
    report = sender.send(_buckets(w1), {"payload": "full"})
    assert run.result() == 1 and _equal(sink.tensors, w1)
    # the buffer of a and c grew once to the 16 KiB tensor that outgrew the 1 KiB bucket; with two
    # buffers used in turn, b (7 bf16, one 256-byte aligned block) went alone into the second
    second = 256 if buffers == 2 else 0
    assert report.buckets == 3 and report.buffer_bytes == 64 * 64 * 4 + second

    # the sender's engine fails mid-sync: receivers abort, the previous version stays
    run = _Run(receiver, sink)
    with pytest.raises(RuntimeError, match="mid-sync"):
        sender.send(_buckets(w2, fail_after=2), {"payload": "full"})
    err = run.result()
    assert isinstance(err, WeightSyncError) and "aborted" in str(err)
    assert receiver.version == 1 and sink.version == 1 and _equal(sink.tensors, w1)

    # an out-of-order version is refused; the receiver stays in step for the next sync
    run = _Run(receiver, sink)
    with pytest.raises(WeightSyncError, match="not newer"):
        sender.send(_buckets(w2), {"payload": "full"}, version=1)
    assert isinstance(run.result(), WeightSyncError) and _equal(sink.tensors, w1)

    # a sink that rejects a tensor: refused as a whole, nothing applied
    class Picky(StagingSink):
        def stage(self, name: str, tensor: torch.Tensor) -> None:
            if name == "c":
                raise InvalidInput("no room for c")
            super().stage(name, tensor)

    picky = Picky()
    run = _Run(receiver, picky)
    with pytest.raises(WeightSyncError, match="no room for c"):
        sender.send(_buckets(w2), {"payload": "full"}, version=5)
    assert isinstance(run.result(), WeightSyncError) and picky.version is None and receiver.version == 1

    run = _Run(receiver, sink)
    sender.send(_buckets(w3), {"payload": "full"}, version=6)
    assert run.result() == 6 and _equal(sink.tensors, w3) and sink.header == {"payload": "full"}


class _HoldFirst(StagingSink):
    """Holds the first staged bucket until ``go`` is set (at most ``wait_s``); records whether it was."""

    def __init__(self, go: threading.Event, wait_s: float) -> None:
        super().__init__()
        self.go, self.wait_s, self.overlapped = go, wait_s, False

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        if name == "a":
            self.overlapped = self.go.wait(self.wait_s)
        super().stage(name, tensor)


def test_two_buffers_pack_the_next_bucket_while_one_is_received() -> None:
    """With two buffers the sender packs and posts bucket 1 while the receiver still holds bucket 0
    (the bucket stream is asked for bucket 2 before the receiver is done with bucket 0)."""
    dev = get_device("cpu")
    sender = WeightSender.colocated(dev, bucket_bytes=1024, timeout_s=30, wait=False, buffers=2)
    receiver = WeightReceiver.colocated(dev, ("127.0.0.1", sender.port), timeout_s=30)
    sender.wait_for_receivers()
    go = threading.Event()
    w = _weights(4)

    def stream() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for i, (name, t) in enumerate(w.items()):
            if i == 2:
                go.set()  # bucket 1 went out: set only if the sender did not wait for bucket 0's answer
            yield [(name, t)]

    sink = _HoldFirst(go, wait_s=5.0)
    try:
        # the first sync announces (and waits for the receiver to map) each buffer: warm them up
        run = _Run(receiver, StagingSink())
        sender.send(stream(), {"payload": "full"})
        assert run.result() == 1
        go.clear()
        run = _Run(receiver, sink)
        report = sender.send(stream(), {"payload": "full"})
        assert run.result() == 2 and _equal(sink.tensors, w) and report.buckets == 3
        assert sink.overlapped
    finally:
        receiver.close()
        sender.close()


def test_constructor_validation() -> None:
    dev = get_device("cpu")
    with pytest.raises(ConfigError, match="port 0"):
        WeightSender.disaggregated(dev, ("127.0.0.1", 0))
    with pytest.raises(ConfigError, match="at least one"):
        WeightSender.colocated(dev, num_receivers=0, wait=False)
    with pytest.raises(ConfigError, match="buffers=0"):
        WeightSender.colocated(dev, wait=False, buffers=0)
    with pytest.raises(ConfigError, match="rank"):
        WeightReceiver.colocated(dev, ("127.0.0.1", 1), rank=0)
    port = free_port()
    with pytest.raises(WeightSyncError, match="no sender reachable"):
        WeightReceiver.colocated(dev, ("127.0.0.1", port), timeout_s=1)


@pytest.mark.parametrize(
    "targets, exclude",
    [(("q_proj", "v_proj"), ()), ("all-linear", ()), ("all-linear", ("o_proj", "down_proj"))],
)
def test_lora_header_config_adapts_what_the_engine_adapts(targets: Any, exclude: Any) -> None:
    """The ``adapter_config`` a LoRA sync sends, read by peft, adapts exactly the modules the engines
    adapt for that ``LoraConfig`` (a str target stays peft's str, exclusions travel)."""
    import types

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from underlay.engines._lora import adapted_modules, add_lora
    from underlay.interfaces import EngineConfig, LoraConfig, ModelConfig
    from underlay.rollout.payload import adapter_config

    hf = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    lora = LoraConfig(rank=2, target_modules=targets, exclude_modules=exclude)
    engine = types.SimpleNamespace(config=EngineConfig(model=ModelConfig(hf_config=hf, lora=lora)))
    header = adapter_config(engine)  # type: ignore[arg-type]
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "bias")
    sent = PeftLoraConfig(**{k: header[k] for k in keys})
    with torch.device("meta"):
        received = adapted_modules(get_peft_model(AutoModelForCausalLM.from_config(hf), sent))
        trained = adapted_modules(add_lora(AutoModelForCausalLM.from_config(hf), lora))
    assert received == trained and trained
