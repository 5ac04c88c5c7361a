"""Activation offload: the tensors each decoder layer saves for backward live in host memory between
the layer's forward and its backward.

Mechanism. Every decoder layer's ``forward`` runs inside ``torch.autograd.graph.saved_tensors_hooks``
of one :class:`ActivationOffloader` (installed by :func:`apply_activation_offload` as the outermost
wrapper of the bound ``forward``, around a compiled forward and around transformers' checkpointing
wrapper). Autograd calls the pack hook for every tensor saved inside the layer:

- Without recomputation, these are all of the layer's saved activations (from eager ops, from the
  graphs ``torch.compile`` builds, whose ``save_for_backward`` goes through the same hooks, and the
  input ``TiledMLP`` keeps). With ``recompute="full"`` (non-reentrant ``torch.utils.checkpoint``) the
  checkpoint saves its inputs (the layer's positional inputs, i.e. the hidden states: the checkpoint
  boundary) through the hooks active outside it (ours) and everything inside through its own inner
  hooks, so exactly the boundary tensors are offloaded and the recomputation reads them back.
- Not offloaded (returned as they are): parameters and views of parameters (FSDP gathers them again
  for backward), tensor subclasses (DTensor, fake tensors), tensors on another device, and tensors
  smaller than ``min_bytes``.
- Views and tensors sharing a storage are copied once per layer: the copy is of the whole storage,
  and each saved tensor is rebuilt on it with its own dtype, size, stride and offset, so aliasing
  between saved tensors of one layer is preserved.

Ordering (accelerators). Each offloaded storage is copied into a pinned host buffer from a
:class:`HostBufferPool` on a dedicated device-to-host stream that first waits on an event recorded on
the compute stream at save time (the copy reads the finished value). The compute stream never waits
for these copies during the layer; the device tensors are kept referenced until the *next* layer's
forward has been issued, and only then does the compute stream wait on the copy event before the
references drop (this is where memory must be freed; one layer of slack is the forward double
buffer). In backward the first unpack of layer ``i`` makes the compute stream wait for layer ``i``'s
host-to-device copy (issued earlier as a prefetch, or now) and starts the prefetch of layer ``i - 1``
on a separate host-to-device stream, so copies of the previous layer overlap this layer's backward;
once every saved tensor of a layer has been unpacked (or the backward reaches another layer), the
offloader drops its references to that layer's device copies (autograd keeps the views it still
uses). The last layer's activations are still on the device when backward begins and are used
without a round trip.
Host buffers go back to the pool when the autograd graph that references them is freed, tagged with
the event after which the last copy touching them is finished.

On the cpu the host is the device: copies are synchronous into separate (unpinned) pool buffers and
the stream and event operations are no-ops, so the pack/unpack, reconstruction, prefetch and release
logic is the one that runs on accelerators.

Contract: a saved tensor must not be modified in place after it was saved (autograd raises for that
without offload; with offload the copy may capture either value, so the rule is the same).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from underlay.interfaces import ConfigError, Device, InvalidInput

__all__ = [
    "DEFAULT_MIN_BYTES",
    "ActivationOffloader",
    "HostBufferPool",
    "OffloadStats",
    "apply_activation_offload",
    "install_activation_offload",
]

DEFAULT_MIN_BYTES = 1 << 20
"""Saved tensors smaller than this (bytes) stay on the device: the copy would cost more in launch and
bookkeeping than the memory it frees."""

_MiB = 1 << 20
_WRAPPED = "_underlay_activation_offload"


def _rounded(nbytes: int) -> int:
    """Allocation size of a pool buffer for ``nbytes``: the next power of two below 1 MiB (at least
    512 bytes), a multiple of 1 MiB above."""
    if nbytes <= _MiB:
        return max(512, 1 << max(nbytes - 1, 1).bit_length())
    return -(-nbytes // _MiB) * _MiB


class HostBufferPool:
    """Reusable host byte buffers (pinned when ``pin``), so that activation offload allocates page-locked
    memory once per shape regime instead of every step.

    ``acquire(n)`` returns a 1-D ``uint8`` cpu tensor of at least ``n`` bytes: the smallest free buffer of
    size in ``[n, 2n]`` whose release event has completed (waiting on the host for it when the best
    fit is still in flight), else a new buffer of ``_rounded(n)`` bytes. ``release(buf, event)`` returns
    it; ``event`` (or ``None``) marks the end of the last device copy that reads or writes it. Bound:
    after every new allocation, free buffers are dropped (largest first) until the reserved bytes are at
    most ``2 * peak_in_use_bytes``, so the pool never holds more than twice the most host memory that
    was in use at once (plus one buffer). ``clear()`` drops every free buffer. Not thread-safe (autograd
    runs the hooks on one thread per device).
    """

    def __init__(self, *, pin: bool) -> None:
        self._pin = pin
        self._free: list[tuple[torch.Tensor, Any]] = []
        self.reserved_bytes = 0
        """Bytes of every buffer the pool owns (free and in use)."""
        self.in_use_bytes = 0
        """Bytes of the buffers handed out and not yet released."""
        self.peak_in_use_bytes = 0
        """Largest ``in_use_bytes`` seen since construction or ``clear()``."""
        self.allocations = 0
        """Buffers allocated (misses)."""
        self.reuses = 0
        """Buffers handed out again (hits)."""

    @property
    def free_buffers(self) -> int:
        """Number of buffers waiting for reuse."""
        return len(self._free)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A host ``uint8`` buffer of at least ``nbytes`` bytes (``InvalidInput`` for ``nbytes < 1``)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidInput(f"HostBufferPool.acquire: nbytes={nbytes!r} must be an int >= 1")
        best = -1
        for i, (buf, _) in enumerate(self._free):
            size = buf.numel()
            if nbytes <= size <= 2 * nbytes and (best < 0 or size < self._free[best][0].numel()):
                best = i
        if best >= 0:
            buf, event = self._free.pop(best)
            if event is not None and not event.query():
                event.synchronize()
            self.reuses += 1
        else:
            size = _rounded(nbytes)
            buf = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self._pin)
            self.allocations += 1
            self.reserved_bytes += size
        self.in_use_bytes += buf.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        if best < 0:
            self._trim(2 * self.peak_in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; it is reused only after ``event`` (a device event or ``None``) completed."""
        self.in_use_bytes -= buf.numel()
        self._free.append((buf, event))

    def _trim(self, limit: int) -> None:
        self._free.sort(key=lambda item: item[0].numel())
        while self._free and self.reserved_bytes > limit:
            buf, event = self._free.pop()
            if event is not None:
                event.synchronize()
            self.reserved_bytes -= buf.numel()

    def clear(self) -> None:
        """Drop every free buffer (after its copies finished); buffers in use stay valid and return
        to the pool when released."""
        self._trim(0)
        self.peak_in_use_bytes = self.in_use_bytes


@dataclass
class OffloadStats:
    """Counters of one :class:`ActivationOffloader` (cumulative; ``reset()`` zeroes them)."""

    offloaded_tensors: int = 0
    """Saved tensors whose data went to host memory (views of one storage count each)."""
    copied_bytes: int = 0
    """Bytes copied device-to-host (one copy per storage per layer)."""
    skipped_params: int = 0
    """Saved tensors left on the device because they are parameters or views of parameters."""
    skipped_small: int = 0
    """Saved tensors left on the device because they are smaller than ``min_bytes``."""
    skipped_limit: int = 0
    """Saved tensors left on the device because ``host_limit_bytes`` would be exceeded."""
    skipped_other: int = 0
    """Saved tensors left as they are: subclasses (DTensor, fake tensors), another device, sparse."""
    fetched_layers: int = 0
    """Layer activations brought back host-to-device in backward."""
    prefetched_layers: int = 0
    """Of those, fetches issued ahead of the layer's backward (while the next layer's backward ran)."""
    resident_layers: int = 0
    """Layers whose backward began before their device tensors were released (no round trip)."""

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


class _Streams:
    """Stream and event operations: real side streams on accelerators, no-ops on the cpu (where every
    copy is synchronous). ``None`` stands for "no stream"/"no event". Device-generic: ``torch.Stream``,
    ``torch.Event`` and ``torch.accelerator`` (one API family, so events of one stream can be waited
    on by any other, whatever the accelerator)."""

    def __init__(self, device: Device, torch_device: torch.device) -> None:
        self._torch_device = torch_device
        self.d2h: torch.Stream | None = None
        self.h2d: torch.Stream | None = None
        if device.is_accelerator:
            self.d2h = torch.Stream(device=torch_device)
            self.h2d = torch.Stream(device=torch_device)

    def compute(self) -> torch.Stream | None:
        """The stream the caller is queueing work on now."""
        if self.d2h is None:
            return None
        return torch.accelerator.current_stream(self._torch_device)

    @staticmethod
    def mark(stream: torch.Stream | None) -> Any:
        """An event recorded on ``stream`` now (``None`` without streams)."""
        return None if stream is None else stream.record_event()

    @staticmethod
    def wait(stream: torch.Stream | None, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event`` (no host wait)."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream: torch.Stream | None) -> Iterator[None]:
        """Queue work on ``stream`` inside the block (then on the stream that was current before)."""
        if stream is None:
            yield
            return
        previous = torch.accelerator.current_stream(self._torch_device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)


@dataclass(eq=False)
class _Group:
    """The offloaded activations of one layer in one forward pass.

    ``host``: storage key -> (host buffer, nbytes); ``device``: storage key -> ``uint8`` device tensor
    over the data (the original storage until released after forward; a fetched copy in backward);
    ``hosts``/``events`` are shared with the finalizer that returns the buffers to the pool when the
    autograd graph drops the group."""

    pass_id: int
    index: int
    host: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    device: dict[int, torch.Tensor] = field(default_factory=dict)
    hosts: list[torch.Tensor] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    copied: Any = None
    fetched: Any = None
    fetch_waited: bool = True
    saved: int = 0
    unpacked: int = 0


@dataclass(frozen=True, eq=False)
class _Handle:
    """What autograd keeps for an offloaded saved tensor: its group, storage key and view geometry."""

    group: _Group
    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _storage_keys(params: Iterable[nn.Parameter]) -> Iterator[int]:
    for p in params:
        if type(p) is nn.Parameter or type(p) is torch.Tensor:  # a DTensor (sharded) has no local storage key
            yield p.untyped_storage().data_ptr()


def _release_host(pool: HostBufferPool, hosts: list[torch.Tensor], events: list[Any]) -> None:
    event = events[-1] if events else None
    for buf in hosts:
        pool.release(buf, event)
    hosts.clear()


class ActivationOffloader:
    """Moves the saved activations of decoder layers to host memory and back (see the module docstring).

    ``device``: where the layers compute; ``min_bytes``: saved tensors smaller than this stay on the
    device (``ConfigError`` unless an int >= 0); ``pool``: host buffers (default: pinned on accelerators,
    plain on the cpu). Use :meth:`layer_scope` around one layer's forward (what
    :func:`apply_activation_offload` installs). One offloader serves one model on one device.
    """

    def __init__(
        self, device: Device, *, min_bytes: int = DEFAULT_MIN_BYTES, pool: HostBufferPool | None = None
    ):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ConfigError(f"activation offload min_bytes={min_bytes!r}: use an int >= 0 (bytes)")
        self._device = device
        self._torch_device = device.torch_device() if device.is_accelerator else torch.device("cpu")
        self._streams = _Streams(device, self._torch_device)
        self.min_bytes = min_bytes
        self.enabled = True
        """``False``: layers run without the hooks (nothing offloaded) until set back."""
        self.host_limit_bytes: int | None = None
        """Most host bytes in use at once (``None``: no limit); a storage that would pass it stays on
        the device (counted in ``stats.skipped_limit``)."""
        self.pool = pool if pool is not None else HostBufferPool(pin=device.is_accelerator)
        self.stats = OffloadStats()
        self._pass = 0
        self._last_index = -1
        self._groups: dict[tuple[int, int], weakref.ref[_Group]] = {}
        self._held: list[_Group] = []  # forward groups whose device tensors are still referenced
        self._backward: _Group | None = None  # the group whose backward runs now
        # groups with a host-to-device copy that the compute stream has not waited for yet
        self._fetching: list[_Group] = []
        self._unpack_eager = torch.compiler.disable(self._unpack)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def layer_scope(self, index: int, params: Iterable[nn.Parameter] = ()) -> Iterator[None]:
        """Offload what autograd saves inside the block as the activations of layer ``index`` (layers of
        one forward pass are entered in increasing ``index``; a non-increasing index starts a new pass).
        ``params``: the layer's parameters (their storages are never offloaded)."""
        if not self.enabled:
            yield
            return
        if index <= self._last_index:
            self._new_pass()
        self._last_index = index
        group = _Group(self._pass, index)
        self._groups[(self._pass, index)] = weakref.ref(group)
        weakref.finalize(group, _release_host, self.pool, group.hosts, group.events)
        param_keys = frozenset(_storage_keys(params))
        # the hooks run between compiled graphs too: never trace them (they copy, record events and
        # key storages by address, all of which must happen for real, every call)
        pack = torch.compiler.disable(functools.partial(self._pack, group, param_keys))  # type: ignore[no-untyped-call]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack_eager):
                yield
        finally:
            self._end_layer(group)

    def _new_pass(self) -> None:
        self._pass += 1
        self._drop_all()
        self._groups = {k: r for k, r in self._groups.items() if r() is not None}

    def _offloadable(self, t: torch.Tensor, param_keys: frozenset[int]) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self._torch_device:
            if isinstance(t, nn.Parameter):
                self.stats.skipped_params += 1
            else:
                self.stats.skipped_other += 1
            return False
        base = t._base
        if isinstance(base, nn.Parameter) or t.untyped_storage().data_ptr() in param_keys:
            self.stats.skipped_params += 1
            return False
        if t.numel() * t.element_size() < max(self.min_bytes, 1):
            self.stats.skipped_small += 1
            return False
        return True

    def _pack(self, group: _Group, param_keys: frozenset[int], t: torch.Tensor) -> Any:
        if not self._offloadable(t, param_keys):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in group.host:
            nbytes = storage.nbytes()
            limit = self.host_limit_bytes
            if limit is not None and self.pool.in_use_bytes + nbytes > limit:
                self.stats.skipped_limit += 1
                return t
            host = self.pool.acquire(nbytes)
            group.hosts.append(host)
            src = _bytes_of(storage, t.device)
            streams = self._streams
            compute = streams.compute()
            streams.wait(streams.d2h, streams.mark(compute))  # copy the value as of now
            with streams.on(streams.d2h):
                host[:nbytes].copy_(src, non_blocking=streams.d2h is not None)
            group.host[key] = (host, nbytes)
            group.device[key] = src  # keeps the storage alive until the copy is known finished
            self.stats.copied_bytes += nbytes
        self.stats.offloaded_tensors += 1
        group.saved += 1
        return _Handle(group, key, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _end_layer(self, group: _Group) -> None:
        streams = self._streams
        group.copied = streams.mark(streams.d2h)
        if group.copied is not None:
            group.events.append(group.copied)
        if group.host:
            self._held.append(group)
        # double buffer: the previous layer's copies had this layer's forward to finish
        self._release_held(keep=1)

    def _release_held(self, keep: int) -> None:
        """Drop the device tensors of all but the newest ``keep`` held forward groups, after making the
        compute stream wait for their device-to-host copies."""
        while len(self._held) > keep:
            old = self._held.pop(0)
            self._clear_device(old)

    # ----------------------------------------------------------------------------------- backward

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            result: torch.Tensor = packed
            return result
        group = packed.group
        data = self._device_bytes(group, packed.key)
        view = torch.empty(0, dtype=packed.dtype, device=data.device).set_(
            data.untyped_storage(), packed.offset, packed.size, packed.stride
        )
        group.unpacked += 1
        if group.unpacked % group.saved == 0 and group is self._backward:
            # every saved tensor of the layer was handed to autograd, which keeps what it still
            # needs: drop ours now, not when the next layer's backward (or the next step) begins
            self._clear_device(group)
            self._backward = None
        return view

    def _device_bytes(self, group: _Group, key: int) -> torch.Tensor:
        """The device data of storage ``key`` of ``group``, with the compute stream ordered after its
        arrival; entering a new group's backward releases the previous one and prefetches the next."""
        if group is not self._backward:
            self._enter_backward(group)
        data = group.device.get(key)
        if data is None:  # released after an earlier backward (retain_graph): fetch again
            self._fetch(group, prefetch=False)
            self._wait_fetch(group)
            data = group.device[key]
        return data

    def _enter_backward(self, group: _Group) -> None:
        """The backward reached ``group``: release the layer whose backward finished and prefetches
        nobody will use, make ``group``'s data ready on the compute stream, prefetch the layer before."""
        if self._backward is not None:
            self._clear_device(self._backward)
        self._backward = None
        for other in self._fetching:
            if other is not group:
                self._clear_device(other)
        if group in self._held:  # still referenced since forward: use the tensors as they are
            self._held.remove(group)
            self.stats.resident_layers += 1
        self._release_held(keep=0)
        if not group.device:
            self._fetch(group, prefetch=False)
        self._wait_fetch(group)
        self._backward = group
        ref = self._groups.get((group.pass_id, group.index - 1))
        target = ref() if ref is not None else None
        if target is not None and target.host and not target.device:
            self._fetch(target, prefetch=True)

    def _fetch(self, group: _Group, *, prefetch: bool) -> None:
        """Queue the host-to-device copies of ``group`` on the h2d stream (device buffers allocated on
        the compute stream, which the copy waits for, so it never overwrites memory still in use)."""
        streams = self._streams
        compute = streams.compute()
        buffers = {
            key: torch.empty(nbytes, dtype=torch.uint8, device=self._torch_device)
            for key, (_, nbytes) in group.host.items()
        }
        streams.wait(streams.h2d, streams.mark(compute))
        with streams.on(streams.h2d):
            for key, (host, nbytes) in group.host.items():
                buffers[key].copy_(host[:nbytes], non_blocking=streams.h2d is not None)
        group.device = buffers
        group.fetched = streams.mark(streams.h2d)
        if group.fetched is not None:
            group.events.append(group.fetched)
            group.fetch_waited = False
            self._fetching.append(group)
        self.stats.fetched_layers += 1
        self.stats.prefetched_layers += int(prefetch)

    def _wait_fetch(self, group: _Group) -> None:
        """Order the compute stream after ``group``'s host-to-device copy (once)."""
        if not group.fetch_waited:
            self._streams.wait(self._streams.compute(), group.fetched)
            group.fetch_waited = True
        self._fetching = [g for g in self._fetching if g is not group]

    def _clear_device(self, group: _Group) -> None:
        """Drop ``group``'s device tensors. The memory returns to the compute stream's pool, so that
        stream first waits for every copy that reads (device-to-host) or writes (host-to-device) it."""
        streams = self._streams
        streams.wait(streams.compute(), group.copied)
        self._wait_fetch(group)
        group.device.clear()

    def _drop_all(self) -> None:
        self._release_held(keep=0)
        if self._backward is not None:
            self._clear_device(self._backward)
        self._backward = None
        for group in list(self._fetching):
            self._clear_device(group)

    # ------------------------------------------------------------------------------------ release

    def release(self) -> None:
        """Drop every device tensor the offloader still references and every free host buffer
        (``HostBufferPool.clear``); buffers of live autograd graphs return to the pool when those are
        freed. Call when the model is offloaded or torn down."""
        self._drop_all()
        self._groups = {k: r for k, r in self._groups.items() if r() is not None}
        self._last_index = -1
        self._pass += 1
        self.pool.clear()


def apply_activation_offload(model: nn.Module, offloader: ActivationOffloader) -> int:
    """Run every decoder layer's ``forward`` of ``model`` inside ``offloader.layer_scope`` (in place;
    install after ``torch.compile`` of the layers so the scope is outermost; idempotent: an installed
    wrapper is replaced). Without gradients (``no_grad``, inference) the layers run unchanged.
    Returns the number of layers wrapped (``ConfigError`` when the model has no decoder layers)."""
    from underlay.engines.fsdp2.parallelize import decoder_layers

    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        inner = layer.__dict__.get("forward")
        original = getattr(inner, _WRAPPED, None)
        if original is not None:
            inner = original
        if inner is None:
            # looked up at call time: fully_shard later swaps the layer's class for a subclass, and
            # transformers checkpoints only when the class's own forward wrapper is the outermost one
            inner = functools.partial(_class_forward, layer)
        layer.forward = _wrap(layer, index, inner, offloader)
    return len(layers)


def _class_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)


def _wrap(
    layer: nn.Module, index: int, inner: Callable[..., Any], offloader: ActivationOffloader
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        with offloader.layer_scope(index, layer.parameters()):
            return inner(*args, **kwargs)

    forward.__doc__ = getattr(inner, "__doc__", None)
    setattr(forward, _WRAPPED, inner)
    return forward


def install_activation_offload(model: nn.Module, device: Device, options: Any) -> ActivationOffloader | None:
    """The engine's build step: when ``options.activation_offload`` (an ``FSDP2Options``), an offloader
    for ``device`` with ``options.activation_offload_min_bytes`` installed on every decoder layer of
    ``model`` (call after compiling the layers); ``None`` otherwise."""
    if not options.activation_offload:
        return None
    offloader = ActivationOffloader(device, min_bytes=options.activation_offload_min_bytes)
    apply_activation_offload(model, offloader)
    return offloader
