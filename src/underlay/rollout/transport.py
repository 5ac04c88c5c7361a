"""``WeightSender`` / ``WeightReceiver``: move weight buckets from trainer ranks to inference workers.

One sync is a message sequence ``begin(version, header)``, ``bucket`` x N, ``end(counts)`` on a
control channel (a ``torch.distributed.TCPStore`` hosted by the sending trainer rank, JSON values,
nothing unpickled), while the bytes of each bucket travel on a data link:

- colocated (trainer and inference worker on one device): reusable bucket buffers that both
  processes map: POSIX shared memory on the cpu, a CUDA IPC handle of device memory on cuda (the
  receiver copies straight out of the trainer's memory). Two buffers by default, used in turn: the
  sender gathers and packs bucket ``k + 1`` while the receivers copy bucket ``k`` out, and waits for
  their answer to bucket ``k - 1`` before it overwrites that buffer. Peak extra memory on the
  trainer: ``buffers`` buckets (each the largest of ``bucket_bytes`` and the largest single tensor).
  Other devices are refused with ``UnsupportedOperation`` (use the disaggregated link).
- disaggregated: a process group of its own (rank 0 = the sending trainer rank, ranks 1..n = the
  receivers) built on its own TCPStore rendezvous, outside the trainer's default group, with the
  device's backend (``Device.dist_backend``: nccl, hccl through torch's backend plugins, gloo). Each
  bucket is one broadcast; the next bucket is gathered and packed while the previous one is on the
  wire (two buckets in flight).

The receiver checks the sequence (versions strictly increase, bucket numbers contiguous, counts in
``end`` match) and hands tensors to a ``WeightSink`` that stages them; only a complete, in-order sync is
committed. A refused, partial or broken sync (sender killed, timeout, bad message) aborts the sink: the
live weights stay those of the previous version.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from underlay.interfaces import (
    BackendUnavailable,
    ConfigError,
    Device,
    Fp8Quantizer,
    InvalidInput,
    ParallelEngine,
    UnderlayError,
    UnsupportedOperation,
)
from underlay.rollout.codec import TensorMeta, pack_into, plan, unpack
from underlay.rollout.payload import WeightPayload, payload_buckets, payload_header
from underlay.rollout.sinks import WeightSink, stage_bucket

__all__ = ["SyncReport", "WeightReceiver", "WeightSender", "WeightSyncError"]

Bucket = list[tuple[str, torch.Tensor]]
_PREFIX = "underlay/weight_sync"


class WeightSyncError(UnderlayError, RuntimeError):
    """A weight sync did not complete: refused by a receiver, aborted by the sender, or the link broke.
    On the receiver the previous version stays live."""


@dataclass(frozen=True)
class SyncReport:
    """What one ``WeightSender.sync`` did on this rank. ``nbytes``/``tensors``/``buckets`` are what was
    sent (0 on a rank that only iterates); ``seconds`` is wall time from the first bucket request to
    the receivers' final acknowledgement; ``buffer_bytes`` is the extra transport memory held."""

    version: int
    buckets: int
    tensors: int
    nbytes: int
    seconds: float
    buffer_bytes: int
    receivers: tuple[str, ...] = field(default=())

    @property
    def gb_per_s(self) -> float:
        """``nbytes / seconds`` in GB/s (1e9 bytes)."""
        return self.nbytes / max(self.seconds, 1e-12) / 1e9


# ------------------------------------------------------------------------------------ control channel


class _Control:
    """JSON messages over a TCPStore: the sender posts ``m{i}``, receiver ``r`` answers ``a{i}.{r}``."""

    def __init__(self, store: Store) -> None:
        self.store = PrefixStore(f"{_PREFIX}/ctl", store)

    def post(self, key: str, value: Mapping[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def read(self, key: str) -> dict[str, Any]:
        raw = self.store.get(key)
        value = json.loads(raw.decode("utf-8"))
        if not isinstance(value, dict):
            raise InvalidInput(f"weight sync control message {key!r} is not a JSON object")
        return value

    def drop(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.store.delete_key(k)


def _server_store(host: str, port: int, timeout_s: float) -> TCPStore:
    try:
        return TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError subclasses
        raise ConfigError(
            f"weight sync: cannot listen on {host}:{port} ({exc}); pass a free port (0 picks one)"
        ) from exc


def _client_store(host: str, port: int, timeout_s: float) -> TCPStore:
    try:
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"weight sync: no sender reachable at {host}:{port} within {timeout_s:.0f} s ({exc}); start "
            "the WeightSender first and pass its address"
        ) from exc


def _check_timeout(timeout_s: float) -> None:
    if not timeout_s > 0:
        raise ConfigError(f"weight sync timeout_s={timeout_s!r}: use a positive number of seconds")


# ------------------------------------------------------------------------------------ data links


class _SendLink:
    """Sender side of a data link: moves one packed bucket to every receiver.

    ``slots``: how many buckets may be in the receivers' hands at once. A shared-buffer link holds one
    buffer per slot: while the receivers copy bucket ``k`` out of slot ``k % slots``, the sender
    gathers and packs bucket ``k + 1`` into the next slot."""

    kind = ""
    buffer_bytes = 0
    slots = 1

    def setup_messages(self, nbytes: int, slot: int) -> list[dict[str, Any]]:
        """Messages to post (and have acknowledged) before a bucket of ``nbytes`` can go in ``slot``."""
        return []

    def mapped(self) -> None:
        """Every receiver acknowledged the setup messages."""

    def stage(self, bucket: Bucket, metas: list[TensorMeta], nbytes: int, slot: int) -> None:
        """Pack ``bucket`` into ``slot``'s buffer (may start an asynchronous transfer). The caller
        guarantees that no receiver still reads that slot."""

    def launch(self) -> None:
        """Start moving the staged bucket (after its message was posted)."""

    def finish(self) -> None:
        """Block until the bucket launched last is out of the sender's hands."""

    def close(self) -> None:
        """Release buffers."""


class _RecvLink:
    """Receiver side: maps a bucket message to a uint8 buffer holding its bytes."""

    def on_setup(self, msg: Mapping[str, Any]) -> None:
        """Apply a setup message (a new shared buffer for one slot)."""

    def fetch(self, nbytes: int, slot: int) -> torch.Tensor:
        """The bytes of the current bucket (valid until the next call)."""
        raise NotImplementedError  # pragma: no cover - every link overrides it

    def release(self) -> None:
        """The sink is done with the current bucket: its reads of the buffer must have finished
        before the sender may overwrite it."""

    def close(self) -> None:
        """Release buffers."""


def _check_slots(slots: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigError(
            f"weight sync buffers={slots!r}: use an int >= 1 (2, the default, overlaps the receivers' "
            "copy of one bucket with the gather of the next; 1 halves the transport memory)"
        )
    return slots


def _slot_buffer(bufs: Mapping[int, torch.Tensor], slot: int, nbytes: int) -> torch.Tensor:
    buf = bufs.get(slot)
    if buf is None or buf.numel() < nbytes:
        raise InvalidInput(
            f"bucket of {nbytes} bytes in slot {slot}, but no shared buffer that large was announced there"
        )
    return buf


class _ShmSend(_SendLink):
    """cpu colocated: one reusable shared-memory buffer per slot (a tmpfs file mapped ``MAP_SHARED``
    by both processes and unlinked as soon as the receivers mapped it), grown when a bucket needs more."""

    kind = "shm"

    def __init__(self, slots: int) -> None:
        self.slots = _check_slots(slots)
        self._views: list[torch.Tensor | None] = [None] * slots
        self._paths: list[str] = []

    def setup_messages(self, nbytes: int, slot: int) -> list[dict[str, Any]]:
        view = self._views[slot]
        if view is not None and view.numel() >= nbytes:
            return []
        self._views[slot] = None
        size = max(nbytes, 1)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(root, f"underlay_weight_sync_{os.getpid()}_{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._views[slot] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._paths.append(path)
        self.buffer_bytes = sum(v.numel() for v in self._views if v is not None)
        return [{"type": "buffer", "link": "shm", "slot": slot, "path": path, "nbytes": size}]

    def mapped(self) -> None:
        """Every receiver mapped the buffers: remove their names (the mappings stay valid)."""
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._paths = []

    def stage(self, bucket: Bucket, metas: list[TensorMeta], nbytes: int, slot: int) -> None:
        view = self._views[slot]
        assert view is not None
        pack_into(view, bucket, metas)

    def close(self) -> None:
        self.mapped()
        self._views = [None] * self.slots
        self.buffer_bytes = 0


class _ShmRecv(_RecvLink):
    def __init__(self) -> None:
        self._views: dict[int, torch.Tensor] = {}

    def on_setup(self, msg: Mapping[str, Any]) -> None:
        slot = int(msg.get("slot", 0))
        self._views.pop(slot, None)
        self._views[slot] = torch.from_file(
            str(msg["path"]), shared=True, size=int(msg["nbytes"]), dtype=torch.uint8
        )

    def fetch(self, nbytes: int, slot: int) -> torch.Tensor:
        return _slot_buffer(self._views, slot, nbytes)

    def close(self) -> None:
        self._views = {}


def _encode_ipc(t: torch.Tensor) -> dict[str, Any]:
    """JSON form of ``reduce_tensor``'s CUDA IPC handle for ``t``."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)  # type: ignore[no-untyped-call]
    (_, size, stride, offset, _, dtype, dev, handle, ssize, soff, _, rc_handle, rc_off, ev, ev_sync) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": str(dtype).removeprefix("torch."),
        "device": int(dev),
        "handle": handle.hex(),
        "storage_size": int(ssize),
        "storage_offset": int(soff),
        "ref_counter_handle": rc_handle.hex(),
        "ref_counter_offset": int(rc_off),
        "event_handle": ev.hex() if ev is not None else None,
        "event_sync_required": bool(ev_sync),
    }


def _decode_ipc(msg: Mapping[str, Any]) -> torch.Tensor:
    """Open a CUDA IPC handle written by ``_encode_ipc`` (same node, the sender's device)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ev = msg["event_handle"]
    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call,no-any-return]
        torch.Tensor,
        torch.Size(msg["size"]),
        tuple(msg["stride"]),
        int(msg["offset"]),
        torch.storage.TypedStorage,
        getattr(torch, str(msg["dtype"])),
        int(msg["device"]),
        bytes.fromhex(msg["handle"]),
        int(msg["storage_size"]),
        int(msg["storage_offset"]),
        False,
        bytes.fromhex(msg["ref_counter_handle"]),
        int(msg["ref_counter_offset"]),
        bytes.fromhex(ev) if ev is not None else None,
        bool(msg["event_sync_required"]),
    )


class _IpcSend(_SendLink):
    """cuda colocated: one reusable device buffer per slot, each shared once through a CUDA IPC handle."""

    kind = "cuda_ipc"

    def __init__(self, device: Device, torch_device: torch.device, slots: int) -> None:
        self._device, self._torch_device = device, torch_device
        self.slots = _check_slots(slots)
        self._bufs: list[torch.Tensor | None] = [None] * slots

    def setup_messages(self, nbytes: int, slot: int) -> list[dict[str, Any]]:
        buf = self._bufs[slot]
        if buf is not None and buf.numel() >= nbytes:
            return []
        self._bufs[slot] = None
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._torch_device)
        self._bufs[slot] = buf
        self.buffer_bytes = sum(b.numel() for b in self._bufs if b is not None)
        return [{"type": "buffer", "link": "cuda_ipc", "slot": slot, "ipc": _encode_ipc(buf)}]

    def stage(self, bucket: Bucket, metas: list[TensorMeta], nbytes: int, slot: int) -> None:
        buf = self._bufs[slot]
        assert buf is not None
        pack_into(buf, bucket, metas)
        self._device.synchronize()  # the receiver reads through its own context: bytes must be there

    def close(self) -> None:
        self._bufs = [None] * self.slots
        self.buffer_bytes = 0


class _IpcRecv(_RecvLink):
    def __init__(self, device: Device) -> None:
        self._device = device
        self._bufs: dict[int, torch.Tensor] = {}

    def on_setup(self, msg: Mapping[str, Any]) -> None:
        slot = int(msg.get("slot", 0))
        self._bufs.pop(slot, None)
        self._bufs[slot] = _decode_ipc(msg["ipc"])

    def fetch(self, nbytes: int, slot: int) -> torch.Tensor:
        return _slot_buffer(self._bufs, slot, nbytes)

    def release(self) -> None:
        # the sink's copies out of the shared buffer run asynchronously on this process's stream
        self._device.synchronize()

    def close(self) -> None:
        self._bufs = {}


def _new_group(store: Store, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``world`` ranks on ``store`` alone (no default group involved)."""
    prefix = PrefixStore(f"{_PREFIX}/pg", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise BackendUnavailable(
                "dist", "nccl", "this torch build has no NCCL", ["gloo"], "install a CUDA build of torch"
            )
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world, opts)
    plugin = dist.Backend._plugins.get(backend.upper())
    if plugin is None:
        raise BackendUnavailable(
            "dist",
            backend,
            "no torch.distributed backend of that name is registered in this process",
            [
                "gloo",
                *(["nccl"] if dist.is_nccl_available() else []),
                *[p.lower() for p in dist.Backend._plugins],
            ],
            "import the device's torch extension first (e.g. select the device with underlay.get_device())",
        )
    return plugin.creator_fn(prefix, rank, world, timeout)


def _broadcast(group: Any, buf: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([buf], opts)


class _GroupSend(_SendLink):
    """disaggregated: broadcast of each bucket from group rank 0; one bucket in flight while the
    next is gathered and packed."""

    kind = "broadcast"

    def __init__(self, group: Any, torch_device: torch.device) -> None:
        self._group, self._torch_device = group, torch_device
        self._staged: torch.Tensor | None = None
        self._inflight: tuple[Any, torch.Tensor] | None = None

    def stage(self, bucket: Bucket, metas: list[TensorMeta], nbytes: int, slot: int) -> None:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._torch_device)
        pack_into(buf, bucket, metas)
        self._staged = buf
        inflight = self._inflight[1].numel() if self._inflight is not None else 0
        self.buffer_bytes = max(self.buffer_bytes, buf.numel() + inflight)

    def launch(self) -> None:
        self.finish()
        assert self._staged is not None
        self._inflight = (_broadcast(self._group, self._staged), self._staged)
        self._staged = None

    def finish(self) -> None:
        if self._inflight is not None:
            self._inflight[0].wait()
            self._inflight = None

    def close(self) -> None:
        self.finish()
        self._staged = None


class _GroupRecv(_RecvLink):
    def __init__(self, group: Any, device: Device, torch_device: torch.device) -> None:
        self._group, self._device, self._torch_device = group, device, torch_device
        self._buf: torch.Tensor | None = None

    def fetch(self, nbytes: int, slot: int) -> torch.Tensor:
        size = max(nbytes, 1)
        if self._buf is None or self._buf.numel() < size:
            self._buf = None
            self._buf = torch.empty(size, dtype=torch.uint8, device=self._torch_device)
        view = self._buf[:size]
        _broadcast(self._group, view).wait()
        self._device.synchronize()
        return view

    def close(self) -> None:
        self._buf = None


def _torch_device(device: Device) -> torch.device:
    return device.torch_device() if device.is_accelerator else torch.device("cpu")


# ------------------------------------------------------------------------------------------ sender


class WeightSender:
    """The trainer side of weight sync. Build it on every trainer rank: with ``colocated`` or
    ``disaggregated`` on the rank(s) that send, with ``follower`` on the others; then call ``sync``
    on every rank at the same point (it iterates the engine's weights, which is collective).

    Errors: ``ConfigError`` for bad arguments; ``WeightSyncError`` when a receiver does not connect,
    refuses a sync or stops answering (raised after the collective iteration has finished, so the
    other trainer ranks are not left waiting).
    """

    def __init__(
        self,
        *,
        bucket_bytes: int,
        control: _Control | None,
        link: _SendLink | None,
        num_receivers: int,
        timeout_s: float,
        store: Store | None = None,
        group: Any = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ConfigError(f"WeightSender bucket_bytes={bucket_bytes}: use a positive byte count")
        self.bucket_bytes = bucket_bytes
        self._control, self._link = control, link
        self._n = num_receivers
        self._timeout_s = timeout_s
        self._store, self._group = store, group
        self._msg = 0
        self._loose: list[str] = []
        self.version = 0

    # -- constructors

    @staticmethod
    def _open(address: tuple[str, int], num_receivers: int, timeout_s: float) -> tuple[TCPStore, _Control]:
        _check_timeout(timeout_s)
        if num_receivers < 1:
            raise ConfigError(f"WeightSender num_receivers={num_receivers}: at least one receiver")
        store = _server_store(address[0], address[1], timeout_s)
        return store, _Control(store)

    @property
    def port(self) -> int:
        """The TCP port receivers connect to (useful after binding port 0); 0 on a follower."""
        return int(self._store.port) if isinstance(self._store, TCPStore) else 0

    def wait_for_receivers(self) -> None:
        """Block until every receiver connected (``WeightSyncError`` after ``timeout_s``); needed only
        after ``colocated(..., wait=False)``."""
        if self._control is None:
            return
        keys = [f"hello.{r}" for r in range(1, self._n + 1)]
        try:
            self._control.store.wait(keys, datetime.timedelta(seconds=self._timeout_s))
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync: {self._n} receiver(s) expected, not all connected within "
                f"{self._timeout_s:.0f} s ({exc}); start them with WeightReceiver and this port"
            ) from exc

    @classmethod
    def colocated(
        cls,
        device: Device,
        address: tuple[str, int] = ("127.0.0.1", 0),
        *,
        num_receivers: int = 1,
        bucket_bytes: int = 1 << 28,
        timeout_s: float = 600.0,
        wait: bool = True,
        buffers: int = 2,
    ) -> WeightSender:
        """Sender for receivers on this rank's device: cpu shared memory or CUDA IPC. Listens on
        ``address`` (port 0: any free port, see ``port``); with ``wait`` blocks until
        ``num_receivers`` receivers connected. ``buffers`` shared bucket buffers (default 2: the
        receivers copy one bucket out while the next is gathered and packed; extra memory on the
        trainer: ``buffers`` x the bucket size). Raises ``UnsupportedOperation`` on other devices and
        ``ConfigError`` for ``buffers < 1``."""
        if device.device_type == "cpu":
            link: _SendLink = _ShmSend(buffers)
        elif device.device_type == "cuda":
            link = _IpcSend(device, _torch_device(device), buffers)
        else:
            raise UnsupportedOperation(
                f"colocated weight sync on {device.device_type!r}: underlay shares device memory between "
                "processes only on cuda (IPC handles) and cpu (shared memory); use "
                "WeightSender.disaggregated (a broadcast over the device's own backend) on this device"
            )
        store, control = cls._open(address, num_receivers, timeout_s)
        sender = cls(
            bucket_bytes=bucket_bytes,
            control=control,
            link=link,
            num_receivers=num_receivers,
            timeout_s=timeout_s,
            store=store,
        )
        control.post("session", {"link": link.kind, "receivers": num_receivers})
        if wait:
            sender.wait_for_receivers()
        return sender

    @classmethod
    def disaggregated(
        cls,
        device: Device,
        address: tuple[str, int],
        *,
        num_receivers: int = 1,
        bucket_bytes: int = 1 << 28,
        timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> WeightSender:
        """Sender that broadcasts to ``num_receivers`` processes (other devices or hosts) over a group
        of its own: this rank is rank 0, hosts the rendezvous store on ``address`` and blocks until
        every receiver joined. ``backend`` defaults to ``device.dist_backend``. ``address`` needs a
        fixed port (the receivers must know it before this call returns): port 0 is a ``ConfigError``."""
        if address[1] == 0:
            raise ConfigError(
                "WeightSender.disaggregated: address port 0 cannot be told to the receivers before the group "
                "forms; pass a fixed free port (e.g. underlay.parallel.distributed.free_port())"
            )
        backend = backend or device.dist_backend
        store, control = cls._open(address, num_receivers, timeout_s)
        control.post("session", {"link": "broadcast", "receivers": num_receivers, "backend": backend})
        group = _new_group(store, 0, num_receivers + 1, backend, timeout_s)
        sender = cls(
            bucket_bytes=bucket_bytes,
            control=control,
            link=_GroupSend(group, _torch_device(device)),
            num_receivers=num_receivers,
            timeout_s=timeout_s,
            store=store,
            group=group,
        )
        sender.wait_for_receivers()
        return sender

    @classmethod
    def follower(cls, *, bucket_bytes: int = 1 << 28) -> WeightSender:
        """A trainer rank that takes part in the engine's collective iteration but sends nothing."""
        return cls(bucket_bytes=bucket_bytes, control=None, link=None, num_receivers=0, timeout_s=1.0)

    # -- sending

    def sync(
        self,
        engine: ParallelEngine,
        payload: WeightPayload | None = None,
        *,
        version: int | None = None,
        quantizer: Fp8Quantizer | None = None,
    ) -> SyncReport:
        """Send the engine's weights as ``payload`` (default: full weights) under ``version`` (default:
        the last version sent + 1; receivers refuse one that is not larger than what they hold).
        Collective over the engine's ranks. Returns what this rank sent."""
        payload = payload or WeightPayload()
        header = payload_header(engine, payload)
        buckets = payload_buckets(engine, payload, self.bucket_bytes, quantizer)
        return self.send(buckets, header, version=version)

    def send(
        self,
        buckets: Iterable[Bucket],
        header: Mapping[str, Any] | None = None,
        *,
        version: int | None = None,
    ) -> SyncReport:
        """Send any stream of ``(name, tensor)`` buckets as one sync (``sync`` is this over an engine).
        On a follower the buckets are only iterated."""
        v = self.version + 1 if version is None else version
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidInput(f"WeightSender: version={v!r}; use an int >= 0")
        t0 = time.perf_counter()
        if self._control is None or self._link is None:
            for _ in buckets:
                pass
            self.version = v
            return SyncReport(v, 0, 0, 0, time.perf_counter() - t0, 0)
        n_buckets = n_tensors = n_bytes = 0
        it = iter(buckets)
        link = self._link
        unanswered: collections.deque[int] = collections.deque()  # bucket messages in the receivers' hands
        try:
            self._exchange({"type": "begin", "version": v, "header": dict(header or {})})
            for bucket in it:
                slot = n_buckets % link.slots
                if len(unanswered) >= link.slots:
                    self._await(unanswered.popleft(), "bucket")  # that slot's last bucket was copied out
                metas, nbytes = plan(bucket)
                for setup in link.setup_messages(nbytes, slot):
                    self._exchange(setup)
                    link.mapped()
                # broadcast: packing this bucket overlaps the previous bucket's transfer
                link.stage(bucket, metas, nbytes, slot)
                msg = {
                    "type": "bucket",
                    "seq": n_buckets,
                    "slot": slot,
                    "nbytes": nbytes,
                    "tensors": [m.to_json() for m in metas],
                }
                if link.kind == "broadcast":
                    link.finish()
                    self._loose.append(f"m{self._post(msg)}")
                    link.launch()
                else:
                    unanswered.append(self._post(msg))
                n_buckets += 1
                n_tensors += len(metas)
                n_bytes += sum(m.nbytes for m in metas)
            while unanswered:
                self._await(unanswered.popleft(), "bucket")
            link.finish()
        except WeightSyncError:
            # a receiver is gone: finish the engine's collective iteration so the other trainer
            # ranks are not left waiting, then report
            for _ in it:
                pass
            raise
        except BaseException as exc:
            # the abort's answer comes after the receivers answered every bucket before it
            self._loose += [
                k for i in unanswered for k in (f"m{i}", *(f"a{i}.{r}" for r in range(1, self._n + 1)))
            ]
            self._abort(f"sender failed during the sync: {type(exc).__name__}: {exc}")
            raise
        verdicts = self._exchange(
            {"type": "end", "version": v, "buckets": n_buckets, "tensors": n_tensors, "nbytes": n_bytes}
        )
        self.version = v
        seconds = time.perf_counter() - t0
        bad = [f"receiver {i + 1}: {x}" for i, x in enumerate(verdicts) if x != "ok"]
        if bad:
            raise WeightSyncError(f"weight sync version {v} was not applied: {'; '.join(bad)}")
        return SyncReport(v, n_buckets, n_tensors, n_bytes, seconds, link.buffer_bytes, tuple(verdicts))

    def _post(self, msg: Mapping[str, Any]) -> int:
        assert self._control is not None
        i = self._msg
        self._control.post(f"m{i}", msg)
        self._msg += 1
        return i

    def _exchange(self, msg: Mapping[str, Any]) -> list[str]:
        """Post ``msg`` and wait for every receiver's answer (their ``status`` strings, rank order)."""
        return self._await(self._post(msg), str(msg.get("type")))

    def _await(self, i: int, what: str) -> list[str]:
        """Every receiver's answer to message ``i`` (rank order), then drop the message and answers.
        Messages posted without an answer (broadcast buckets) are deleted once a later one is
        answered: every receiver has read them by then."""
        assert self._control is not None
        keys = [f"a{i}.{r}" for r in range(1, self._n + 1)]
        try:
            self._control.store.wait(keys, datetime.timedelta(seconds=self._timeout_s))
            answers = [str(self._control.read(k).get("status", "?")) for k in keys]
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync: a receiver did not answer message {i} ({what}) within "
                f"{self._timeout_s:.0f} s ({exc}); it died or stopped calling receive()"
            ) from exc
        self._control.drop([*keys, f"m{i}", *self._loose])
        self._loose = []
        return answers

    def _abort(self, reason: str) -> None:
        # answered after the receivers are done with every bucket: then the buffers may go. The
        # receivers may be gone too; the original error is what matters
        with contextlib.suppress(Exception):
            self._exchange({"type": "abort", "reason": reason})
        if self._link is not None:
            self._link.close()

    def close(self) -> None:
        """Release the transport buffer and the rendezvous (receivers see the link closed)."""
        if self._link is not None:
            self._link.close()
        self._link = None
        self._control = None
        self._group = None
        self._store = None


# ---------------------------------------------------------------------------------------- receiver


class WeightReceiver:
    """The inference-worker side of weight sync: ``receive(sink)`` applies one sync through ``sink``.

    ``version`` is the last version committed (``None`` before the first). Raises ``WeightSyncError``
    from ``receive`` when the sync is refused (not newer than ``version``), partial, or the link
    breaks; the sink is aborted and the previous weights stay live. After a failure in the middle of a
    sync (sender killed, link broken) the receiver is unusable (``receive`` raises at once; connect a
    new one to the restarted sender); after a refusal, or a timeout while idle, it stays in step.
    """

    def __init__(self, control: _Control, link: _RecvLink, rank: int, store: Store) -> None:
        self._control, self._link, self._rank, self._store = control, link, rank, store
        self._msg = 0
        self._broken: str | None = None
        self.version: int | None = None

    @classmethod
    def _connect(
        cls, address: tuple[str, int], rank: int, timeout_s: float
    ) -> tuple[TCPStore, _Control, dict[str, Any]]:
        _check_timeout(timeout_s)
        if rank < 1:
            raise ConfigError(f"WeightReceiver rank={rank}: receivers are ranks 1..num_receivers")
        store = _client_store(address[0], address[1], timeout_s)
        control = _Control(store)
        try:
            session = control.read("session")
        except Exception as exc:
            raise WeightSyncError(f"weight sync: sender at {address} sent no session ({exc})") from exc
        return store, control, session

    @classmethod
    def colocated(
        cls, device: Device, address: tuple[str, int], *, rank: int = 1, timeout_s: float = 600.0
    ) -> WeightReceiver:
        """Connect to a colocated ``WeightSender`` at ``address`` as receiver ``rank`` (1-based)."""
        store, control, session = cls._connect(address, rank, timeout_s)
        kind = session.get("link")
        if kind == "shm":
            link: _RecvLink = _ShmRecv()
        elif kind == "cuda_ipc":
            link = _IpcRecv(device)
        else:
            raise WeightSyncError(
                f"weight sync: the sender at {address} uses link {kind!r}; use the matching receiver "
                "constructor (WeightReceiver.disaggregated for 'broadcast')"
            )
        control.post(f"hello.{rank}", {"rank": rank})
        return cls(control, link, rank, store)

    @classmethod
    def disaggregated(
        cls,
        device: Device,
        address: tuple[str, int],
        *,
        rank: int,
        num_receivers: int,
        timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> WeightReceiver:
        """Join the sender's broadcast group at ``address`` as rank ``rank`` of ``num_receivers + 1``.
        Blocks until the whole group formed."""
        store, control, session = cls._connect(address, rank, timeout_s)
        backend = backend or device.dist_backend
        if session.get("link") != "broadcast" or session.get("backend") != backend:
            raise WeightSyncError(
                f"weight sync: the sender at {address} runs {session}; this receiver expected a "
                f"broadcast over {backend!r}"
            )
        control.post(f"hello.{rank}", {"rank": rank})
        group = _new_group(store, rank, num_receivers + 1, backend, timeout_s)
        return cls(control, _GroupRecv(group, device, _torch_device(device)), rank, store)

    def _next(self) -> tuple[int, dict[str, Any]]:
        i = self._msg
        msg = self._control.read(f"m{i}")
        self._msg += 1
        return i, msg

    def _answer(self, i: int, status: str) -> None:
        self._control.post(f"a{i}.{self._rank}", {"status": status})

    def receive(self, sink: WeightSink) -> int:
        """Receive one sync into ``sink``; returns the committed version. See the class docstring."""
        if self._broken is not None:
            raise WeightSyncError(
                f"weight sync receiver is unusable after an earlier failure: {self._broken}"
            )
        problem: str | None = None
        started = consumed = False
        version = -1
        try:
            while True:
                i, msg = self._next()
                consumed = True
                kind = msg.get("type")
                if kind == "buffer":
                    self._link.on_setup(msg)
                    self._answer(i, "ok")
                    continue
                if kind == "abort":
                    self._answer(i, "ok")
                    if started:
                        sink.abort(str(msg.get("reason")))
                    raise WeightSyncError(f"the sender aborted sync {version}: {msg.get('reason')}")
                if kind == "begin":
                    version = int(msg["version"])
                    n_buckets = n_tensors = n_bytes = 0
                    if self.version is not None and version <= self.version:
                        problem = f"refused version {version}: not newer than the live version {self.version}"
                    else:
                        try:
                            sink.begin(version, msg.get("header") or {})
                            started = True
                        except InvalidInput as exc:
                            problem = f"sink refused version {version}: {exc}"
                    self._answer(i, "ok" if problem is None else problem)
                    continue
                if kind == "bucket":
                    if int(msg["seq"]) != n_buckets:
                        problem = problem or f"bucket {msg['seq']} arrived, expected {n_buckets}"
                    metas = [TensorMeta.from_json(m) for m in msg["tensors"]]
                    buf = self._link.fetch(int(msg["nbytes"]), int(msg.get("slot", 0)))
                    if problem is None:
                        try:
                            stage_bucket(sink, unpack(buf, metas))
                        except InvalidInput as exc:
                            problem = str(exc)
                    n_buckets += 1
                    n_tensors += len(metas)
                    n_bytes += sum(m.nbytes for m in metas)
                    if self._link_acks_buckets():
                        self._link.release()
                        self._answer(i, "ok")
                    continue
                if kind == "end":
                    counts = (int(msg["buckets"]), int(msg["tensors"]), int(msg["nbytes"]))
                    if problem is None and counts != (n_buckets, n_tensors, n_bytes):
                        problem = (
                            f"sync {version} is partial: the sender sent {counts} (buckets, tensors, bytes), "
                            f"{(n_buckets, n_tensors, n_bytes)} arrived"
                        )
                    if problem is None:
                        try:
                            sink.commit(version)
                        except InvalidInput as exc:
                            problem = str(exc)
                    if problem is not None:
                        if started:
                            sink.abort(problem)
                        self._answer(i, problem)
                        raise WeightSyncError(problem)
                    self.version = version
                    self._answer(i, "ok")
                    return version
                raise InvalidInput(f"unknown weight sync message type {kind!r}")
        except WeightSyncError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if consumed:  # mid-sync: the message sequence is lost; waiting idle for a sync is not fatal
                self._broken = reason
            if started:
                sink.abort(reason)
            raise WeightSyncError(
                f"weight sync {version} broke off ({reason}); the previous version {self.version} stays live"
            ) from exc

    def _link_acks_buckets(self) -> bool:
        return not isinstance(self._link, _GroupRecv)

    def close(self) -> None:
        """Release the mapped buffer and the connection."""
        self._link.close()
