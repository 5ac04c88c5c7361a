"""Units of ``underlay.engines.fsdp2.act_offload``: the host buffer pool, what the pack hook offloads and
skips, views and shared storages, repeated backward, and a negative control showing that a wrong unpack
order (two layers' saved tensors swapped) changes the gradients the equality tests compare."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from underlay.backends.cpu.device import CpuDevice
from underlay.engines.fsdp2.act_offload import (
    DEFAULT_MIN_BYTES,
    ActivationOffloader,
    HostBufferPool,
    apply_activation_offload,
)
from underlay.interfaces import ConfigError, InvalidInput


def test_pool_reuses_buffers_within_twice_the_request() -> None:
    pool = HostBufferPool(pin=False)
    a = pool.acquire(3000)
    assert a.dtype == torch.uint8 and a.device.type == "cpu" and a.numel() >= 3000
    pool.release(a)
    b = pool.acquire(2500)  # fits in [2500, 5000]: the same buffer
    assert b.data_ptr() == a.data_ptr() and pool.reuses == 1 and pool.allocations == 1
    pool.release(b)
    c = pool.acquire(1000)  # 4096 > 2 * 1000: a new, smaller buffer
    assert c.data_ptr() != a.data_ptr() and pool.allocations == 2 and c.numel() >= 1000
    assert pool.in_use_bytes == c.numel()
    pool.release(c)
    assert pool.in_use_bytes == 0 and pool.free_buffers == 2
    pool.clear()
    assert pool.free_buffers == 0 and pool.reserved_bytes == 0


def test_pool_stays_bounded_over_steps_of_changing_sizes() -> None:
    """Steps whose sizes drift upward: the pool never reserves more than twice the peak in use (plus
    the buffer just allocated), and a repeated step allocates nothing new."""
    pool = HostBufferPool(pin=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        scale = 1 + step // 3
        sizes = [int(s) * scale for s in torch.randint(50_000, 400_000, (6,), generator=gen)]
        bufs = [pool.acquire(n) for n in sizes]
        for buf, n in zip(bufs, sizes):
            assert buf.numel() >= n
        biggest = max(b.numel() for b in bufs)
        assert pool.reserved_bytes <= 2 * pool.peak_in_use_bytes + biggest, (step, pool.reserved_bytes)
        for buf in bufs:
            pool.release(buf)
    before = pool.allocations
    bufs = [pool.acquire(n) for n in sizes]  # the last step again
    assert pool.allocations == before
    for buf in bufs:
        pool.release(buf)


def test_pool_and_offloader_refuse_bad_arguments() -> None:
    pool = HostBufferPool(pin=False)
    for bad in (0, -5, 2.0, True):
        with pytest.raises(InvalidInput, match="nbytes="):
            pool.acquire(bad)  # type: ignore[arg-type]
    for bad_min in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="min_bytes="):
            ActivationOffloader(CpuDevice(), min_bytes=bad_min)  # type: ignore[arg-type]
    assert ActivationOffloader(CpuDevice()).min_bytes == DEFAULT_MIN_BYTES


class _SaveTwoViews(torch.autograd.Function):
    """y = x * x; saves ``x`` and a view of it, and checks in backward that the two still alias."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, x[1:, ::2])
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, view = ctx.saved_tensors
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert view.storage_offset() == x.storage_offset() + x.stride(0)
        assert view.stride() == (x.stride(0), 2 * x.stride(1))
        assert torch.equal(view, x[1:, ::2])
        return 2 * x * grad


def test_views_of_one_storage_are_copied_once_and_restored_aliased() -> None:
    torch.manual_seed(0)
    off = ActivationOffloader(CpuDevice(), min_bytes=0)
    lin = torch.nn.Linear(32, 32, dtype=torch.float64)
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)

    def run(scoped: bool) -> list[torch.Tensor]:
        ctx = off.layer_scope(0, lin.parameters()) if scoped else torch.enable_grad()
        with ctx:
            y = lin(x) * 2  # linear saves its weight (a parameter) and x (a leaf input)
            a = y[:, :16]  # views of y's storage, saved by sin and cos
            b = y.t()
            z = _SaveTwoViews.apply(y.tanh())
            loss = a.sin().sum() + b.cos().sum() + z.sum() + y[::2].exp().sum()
        return list(torch.autograd.grad(loss, [x, lin.weight, lin.bias]))

    ref = run(scoped=False)
    got = run(scoped=True)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    s = off.stats
    assert s.skipped_params >= 1  # the weight
    # distinct storages copied: x (saved by linear), y (viewed by sin and cos), tanh(y) (saved by tanh
    # and twice by _SaveTwoViews) and exp's half-size output; the views add no bytes
    y_bytes = 64 * 32 * 8
    assert s.copied_bytes == 3 * y_bytes + y_bytes // 2, s
    assert s.offloaded_tensors >= 6, s


def test_parameters_and_small_tensors_stay_on_the_device() -> None:
    off = ActivationOffloader(CpuDevice(), min_bytes=1 << 30)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with off.layer_scope(0, lin.parameters()):
        loss = lin(x).sin().sum()
    loss.backward()  # type: ignore[no-untyped-call]
    s = off.stats
    assert s.offloaded_tensors == 0 and s.copied_bytes == 0
    assert s.skipped_params >= 1 and s.skipped_small >= 2
    assert off.pool.allocations == 0


def test_retained_graph_backward_twice_fetches_again() -> None:
    torch.manual_seed(1)
    off = ActivationOffloader(CpuDevice(), min_bytes=0)
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    with off.layer_scope(0):
        h = x.exp()
    with off.layer_scope(1):
        loss = (h.sin() * h).sum()
    loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
    first = x.grad.clone()  # type: ignore[union-attr]
    loss.backward()  # type: ignore[no-untyped-call]
    assert torch.equal(x.grad, 2 * first)  # type: ignore[arg-type]
    expected = (x.exp() * (x.exp().cos() * x.exp() + x.exp().sin())).detach()
    torch.testing.assert_close(first, expected, rtol=1e-14, atol=0)
    assert off.stats.resident_layers >= 1 and off.stats.fetched_layers >= 2


def _tiny_llama(layers: int) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    model.set_attn_implementation("eager")
    return model


class _SwappedLayers(ActivationOffloader):
    """A deliberately wrong offloader: layer 0's saved tensors are read from layer 1's and back (it
    keeps every layer's group alive, since a layer's backward may now read another's)."""

    keep: list[Any]

    def _pack(self, group: Any, param_keys: Any, t: torch.Tensor) -> Any:
        self.__dict__.setdefault("keep", []).append(group)
        return super()._pack(group, param_keys, t)

    def _device_bytes(self, group: Any, key: int) -> torch.Tensor:
        swap = {0: 1, 1: 0}.get(group.index, group.index)
        other = self._groups[(group.pass_id, swap)]()
        assert other is not None
        position = list(group.host).index(key)
        return super()._device_bytes(other, list(other.host)[position])


@pytest.mark.parametrize("recompute", [False, True])
def test_wrong_unpack_order_changes_gradients(recompute: bool) -> None:
    """The equality the engine tests assert is sensitive to the unpack order: the correct offloader
    reproduces the reference gradients exactly, the swapped one does not."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))

    def grads(offloader: ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model = _tiny_llama(3)
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if offloader is not None:
            assert apply_activation_offload(model, offloader) == 3
        model(input_ids=ids).logits.log_softmax(-1).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(None)
    good = ActivationOffloader(CpuDevice(), min_bytes=0)
    same = grads(good)
    # layer 2 is resident when backward starts; layers 1 and 0 are prefetched one layer ahead
    assert good.stats.offloaded_tensors > 0 and good.stats.prefetched_layers == 2
    assert all(torch.equal(ref[n], same[n]) for n in ref)
    wrong = grads(_SwappedLayers(CpuDevice(), min_bytes=0))
    differ = [n for n in ref if not torch.allclose(ref[n], wrong[n], rtol=1e-6, atol=1e-9)]
    assert differ, "swapping two layers' saved tensors left every gradient unchanged"


def test_install_is_idempotent_and_inference_is_untouched() -> None:
    model = _tiny_llama(2)
    off = ActivationOffloader(CpuDevice(), min_bytes=0)
    assert apply_activation_offload(model, off) == 2
    first = model.model.layers[0].forward
    assert apply_activation_offload(model, off) == 2
    assert model.model.layers[0].forward is not first
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        model(input_ids=ids)
    assert off.stats.offloaded_tensors == 0
    model(input_ids=ids).logits.sum().backward()
    per_pass = off.stats.offloaded_tensors
    assert per_pass > 0
    off.stats.reset()
    model(input_ids=ids).logits.sum().backward()
    assert off.stats.offloaded_tensors == per_pass  # wrapped once, not twice


def test_disabled_offloader_and_host_limit_leave_tensors_on_the_device() -> None:
    off = ActivationOffloader(CpuDevice(), min_bytes=0)
    x = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    off.enabled = False
    with off.layer_scope(0):
        loss = x.exp().sin().sum()
    loss.backward()  # type: ignore[no-untyped-call]
    assert off.stats.offloaded_tensors == 0
    off.enabled = True
    off.host_limit_bytes = 32 * 32 * 8  # room for one of the two saved storages
    with off.layer_scope(0):
        loss = x.exp().sin().cos().sum()  # saves e = exp(x) (twice: exp's output, sin's input), sin(e)
    grad = torch.autograd.grad(loss, x)[0]
    e = x.detach().exp()
    torch.testing.assert_close(grad, -e.sin().sin() * e.cos() * e, rtol=1e-14, atol=0)
    assert off.stats.offloaded_tensors == 2 and off.stats.skipped_limit == 1


class _Event:
    """A logged event: already complete (the cpu copies were synchronous)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"E{self.n}"


class _RecordingStreams:
    """Stand-in for the accelerator streams: every mark, wait and stream switch is logged, so that the
    ordering the offloader promises on a real device can be checked on the cpu (copies stay synchronous)."""

    def __init__(self) -> None:
        self.d2h: Any = "d2h"
        self.h2d: Any = "h2d"
        self.log: list[tuple[Any, ...]] = []
        self._events = 0
        self.source: dict[int, str] = {}

    def compute(self) -> Any:
        return "compute"

    def mark(self, stream: Any) -> Any:
        self._events += 1
        event = _Event(self._events)
        self.source[event.n] = stream
        self.log.append(("mark", stream, event))
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            self.log.append(("wait", stream, event))

    def on(self, stream: Any) -> Any:
        self.log.append(("on", stream))
        return torch.enable_grad()  # a no-op context


class _Logged(ActivationOffloader):
    def _clear_device(self, group: Any) -> None:
        had = bool(group.device)
        super()._clear_device(group)
        if had:
            self._streams.log.append(("clear", group.pass_id, group.index, group.copied, group.fetched))  # type: ignore[attr-defined]

    def _device_bytes(self, group: Any, key: int) -> torch.Tensor:
        data = super()._device_bytes(group, key)
        self._streams.log.append(("use", group.pass_id, group.index, group.fetched))  # type: ignore[attr-defined]
        return data


def test_stream_ordering_of_copies_waits_and_frees() -> None:
    """With logged streams: every copy waits for the compute stream first; the compute stream waits for
    a layer's device-to-host copy before its device tensors are freed, and for its host-to-device copy
    before they are used or freed; layer i-1's fetch is issued before layer i's data is used."""
    model = _tiny_llama(4)
    model.train()
    off = _Logged(CpuDevice(), min_bytes=0)
    streams = _RecordingStreams()
    off._streams = streams  # type: ignore[assignment]
    apply_activation_offload(model, off)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # two passes: the second reuses pooled buffers
        model(input_ids=ids).logits.square().mean().backward()
    log = streams.log

    def before(i: int, entry: tuple[Any, ...]) -> bool:
        return entry in log[:i]

    copies = 0
    for i, entry in enumerate(log):
        if entry[0] == "on":  # a copy on a side stream: it waited for a compute-stream mark just before
            prev = log[i - 1]
            assert prev[0] == "wait" and prev[1] == entry[1], log[i - 2 : i + 1]
            assert streams.source[prev[2].n] == "compute", log[i - 2 : i + 1]
            copies += 1
        elif entry[0] == "clear":
            _, _, _, copied, fetched = entry
            assert before(i, ("wait", "compute", copied)), entry
            if fetched is not None:
                assert before(i, ("wait", "compute", fetched)), entry
        elif entry[0] == "use" and entry[3] is not None:
            assert before(i, ("wait", "compute", entry[3])), entry
    clears = [e for e in log if e[0] == "clear"]
    assert copies > 0 and len(clears) == 2 * (4 + 3)  # per pass: 4 forward releases, 3 after backward
    # prefetch: layer i-1's fetch (an h2d mark) is issued before any of layer i-1's data is used
    uses = [e for e in log if e[0] == "use"]
    fetched_layers = {(e[1], e[2]) for e in uses if e[3] is not None}
    assert len(fetched_layers) == 2 * 3  # per pass: layers 2, 1, 0 come back; layer 3 stays resident
    assert off.stats.prefetched_layers == off.stats.fetched_layers == 6
    assert off.pool.reuses > 0
