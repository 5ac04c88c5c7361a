"""Bucket framing: many named tensors packed into one flat byte buffer, and views back out of it.

A bucket travels as one contiguous ``uint8`` buffer plus a JSON-able list of ``TensorMeta``. Every
tensor starts at a multiple of ``ALIGN`` bytes, so ``buffer[offset:offset + nbytes].view(dtype)`` is a
valid, correctly aligned view for every dtype (``float8_e4m3fn`` and ``bool`` included) on every device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from underlay.interfaces import InvalidInput

__all__ = [
    "ALIGN",
    "TensorMeta",
    "dtype_from_name",
    "dtype_name",
    "pack_into",
    "plan",
    "tensor_digest",
    "unpack",
]

ALIGN = 256
"""Byte alignment of every tensor inside a bucket (the CUDA allocator's own granularity)."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``. Raises ``InvalidInput`` for a dtype the codec cannot carry
    (complex, quantized, sub-byte)."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise InvalidInput(f"weight sync cannot carry dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``. Raises ``InvalidInput`` for an unknown name (a corrupt message)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidInput(
            f"weight sync message names dtype {name!r}; supported: {sorted(_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: byte ``offset`` (multiple of ``ALIGN``) and ``nbytes``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[Any]:
        """Compact JSON form ``[name, dtype, shape, offset, nbytes]``."""
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @staticmethod
    def from_json(raw: Sequence[Any]) -> TensorMeta:
        """Inverse of ``to_json``; raises ``InvalidInput`` on a malformed entry."""
        try:
            name, dtype, shape, offset, nbytes = raw
            meta = TensorMeta(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed tensor entry {raw!r} in a weight sync message") from exc
        dtype_from_name(meta.dtype)
        return meta


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def plan(entries: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Offsets of ``entries`` in one buffer; returns ``(metas, buffer_nbytes)``. Raises ``InvalidInput``
    for duplicate names or an unsupported dtype."""
    metas: list[TensorMeta] = []
    seen: set[str] = set()
    offset = 0
    for name, t in entries:
        if name in seen:
            raise InvalidInput(f"weight sync bucket names tensor {name!r} twice; names must be unique")
        seen.add(name)
        n = _nbytes(t)
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return metas, offset


def pack_into(
    buffer: torch.Tensor, entries: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]
) -> None:
    """Copy the bytes of each tensor of ``entries`` into ``buffer`` (1-D ``uint8``, large enough for
    ``plan``'s size, on any device: copies cross devices when needed) at its planned offset. Tensors on
    the buffer's device go in one multi-tensor copy (``torch._foreach_copy_``: a few kernel launches per
    bucket on an accelerator instead of one per tensor); the bytes are the same as tensor by tensor."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for (_, t), m in zip(entries, metas):
        if m.nbytes:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            dst = buffer[m.offset : m.offset + m.nbytes]
            if src.device == buffer.device:
                dsts.append(dst)
                srcs.append(src)
            else:
                dst.copy_(src, non_blocking=True)
    if dsts:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` as the tensors ``metas`` describe (no copy; valid while ``buffer`` is).
    Raises ``InvalidInput`` when an entry's size disagrees with its shape or runs past the buffer."""
    out: list[tuple[str, torch.Tensor]] = []
    size = buffer.numel()
    for m in metas:
        dtype = dtype_from_name(m.dtype)
        itemsize = dtype.itemsize
        numel = 1
        for s in m.shape:
            numel *= s
        if numel * itemsize != m.nbytes or m.offset % ALIGN or m.offset + m.nbytes > size:
            raise InvalidInput(
                f"weight sync entry {m.name!r}: {m.nbytes} bytes at offset {m.offset} do not hold "
                f"{m.dtype}{list(m.shape)} inside a {size}-byte bucket; the message is corrupt"
            )
        view = buffer[m.offset : m.offset + m.nbytes].view(dtype).view(m.shape)
        out.append((m.name, view))
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 (hex) of ``t``'s dtype name, shape and bytes in row-major order, from any device (copied
    to the cpu one tensor at a time). Two tensors have the same digest exactly when they are bit-equal
    (up to hash collisions): lets two processes compare gigabytes of weights by exchanging strings.
    Raises ``InvalidInput`` for a dtype the codec cannot carry."""
    h = hashlib.sha256(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()
