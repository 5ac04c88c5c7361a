"""Where received weights go: the ``WeightSink`` protocol and the sinks underlay ships.

A sink sees one sync as ``begin(version, header)``, ``stage(name, tensor)`` for every tensor (the
tensor is a view of the transport's buffer, valid only during the call: a sink copies what it keeps),
then ``commit(version)`` when the sync arrived complete and in order, or ``abort(reason)`` otherwise.
Live weights change only in ``commit``; after ``abort`` they are exactly what the last commit left.

A sink may also define ``stage_many(items)`` (a whole bucket of ``(name, tensor)``, the same
validity and effect as ``stage`` of each in order); the receiver calls it through ``stage_bucket``
when it exists, so a sink can copy a bucket in one multi-tensor copy.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from underlay.interfaces import InvalidInput

__all__ = ["AdapterDirSink", "ModuleSink", "StagingSink", "WeightSink", "peft_param_name", "stage_bucket"]


@runtime_checkable
class WeightSink(Protocol):
    """Receives one sync at a time; see the module docstring for the call order and validity rules."""

    def begin(self, version: int, header: Mapping[str, Any]) -> None:
        """A sync of ``version`` starts. ``header`` is the sender's JSON description: ``payload``
        (``"full"`` or ``"lora"``), ``fp8`` (``None`` or ``{"block": [bm, bk]}``), ``adapter_config``
        (peft's ``adapter_config.json`` content, LoRA only). Raise ``InvalidInput`` to refuse it."""

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a copy of ``tensor`` (valid only during this call) under ``name``; not live yet. Raise
        ``InvalidInput`` for a name or shape the sink cannot take (the sync is then aborted)."""

    def commit(self, version: int) -> None:
        """Make everything staged since ``begin`` live. Raise ``InvalidInput`` (nothing changes) when
        the staged set is incomplete."""

    def abort(self, reason: str) -> None:
        """Drop what was staged; live weights stay as the last commit left them."""


def stage_bucket(sink: WeightSink, items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Stage one bucket: ``sink.stage_many(items)`` where the sink defines it, else ``sink.stage`` of
    each item in order."""
    many = getattr(sink, "stage_many", None)
    if callable(many):
        many(items)
        return
    for name, tensor in items:
        sink.stage(name, tensor)


def peft_param_name(name: str, adapter: str = "default") -> str:
    """Parameter name in a live peft model of an adapter tensor named as peft saves it:
    ``...q_proj.lora_A.weight`` -> ``...q_proj.lora_A.default.weight``. Other names are unchanged."""
    for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
        if part in name:
            head, tail = name.rsplit(part, 1)
            return f"{head}{part}{adapter}.{tail}"
    return name


class ModuleSink:
    """Updates the parameters of a ``torch.nn.Module`` (a ``transformers`` model, a peft model) in place.

    Double-buffered: ``stage`` copies each tensor into a persistent staging buffer of the parameter's
    dtype and device (allocated on the first sync, reused afterwards); ``commit`` swaps every staged
    buffer with its parameter's storage, so it costs no copy and the model is never half-updated.
    Extra memory: one copy of the received parameters. Tied parameters (one ``Parameter`` under two
    names) are received once under either name.

    ``rename`` maps a received name to the module's parameter name (``peft_param_name`` for LoRA
    adapters into a peft model). ``required`` selects the parameters every sync must deliver (default:
    all); ``commit`` raises ``InvalidInput`` naming the ones missing. FP8 payloads are refused: this
    sink keeps the module's own dtypes (an FP8 rollout engine consumes them through its own loader).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        rename: Callable[[str], str] | None = None,
        required: Callable[[str], bool] | None = None,
    ) -> None:
        self._params = dict(module.named_parameters(remove_duplicate=False))
        self._rename = rename or (lambda n: n)
        self._required = {id(p): n for n, p in self._params.items() if required is None or required(n)}
        self._staging: dict[int, torch.Tensor] = {}
        self._staged: set[int] = set()
        self._active = False

    @property
    def module_params(self) -> Mapping[str, torch.nn.Parameter]:
        """The module's parameters by name (tied aliases included)."""
        return self._params

    def begin(self, version: int, header: Mapping[str, Any]) -> None:
        """Start staging; refuses FP8 payloads (``InvalidInput``)."""
        if header.get("fp8"):
            raise InvalidInput(
                "ModuleSink received an FP8 payload; send full-precision weights to a torch module "
                "(WeightPayload(fp8=None)) or give the FP8 tensors to an FP8 rollout engine's loader"
            )
        self._staged.clear()
        self._active = True

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the staging buffer of parameter ``rename(name)``."""
        pid, buf = self._buffer_for(name, tensor)
        with torch.no_grad():
            buf.copy_(tensor)
        self._staged.add(pid)

    def _buffer_for(self, name: str, tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The parameter id and staging buffer that receive ``tensor`` under ``name``; raises
        ``InvalidInput`` outside a sync, for an unknown name or a shape mismatch."""
        if not self._active:
            raise InvalidInput(f"ModuleSink.stage({name!r}) outside a sync; call begin first")
        target = self._rename(name)
        param = self._params.get(target)
        if param is None:
            raise InvalidInput(
                f"received tensor {name!r} (module name {target!r}) that the module does not have; the "
                "sender's model differs from the receiver's (check the model config and LoRA settings)"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise InvalidInput(
                f"received {name!r} of shape {tuple(tensor.shape)}, module parameter {target!r} has "
                f"{tuple(param.shape)}; the sender's model differs from the receiver's"
            )
        buf = self._staging.get(id(param))
        if buf is None:
            buf = torch.empty_like(param.data)
            self._staging[id(param)] = buf
        return id(param), buf

    def stage_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``stage`` of every item, checked first, then copied: items whose tensor has its staging
        buffer's dtype and device go in one ``torch._foreach_copy_`` (a few kernel launches per
        bucket on an accelerator instead of one per tensor), the others one by one. Raises
        ``InvalidInput`` as ``stage`` does, before copying anything of the bucket."""
        pairs = [(self._buffer_for(name, tensor), tensor) for name, tensor in items]
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        with torch.no_grad():
            for (_pid, buf), tensor in pairs:
                if buf.dtype == tensor.dtype and buf.device == tensor.device:
                    dsts.append(buf)
                    srcs.append(tensor)
                else:
                    buf.copy_(tensor)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        self._staged.update(pid for (pid, _), _ in pairs)

    def commit(self, version: int) -> None:
        """Swap the staged buffers in; ``InvalidInput`` (nothing swapped) when a required parameter
        was not received."""
        missing = sorted(n for i, n in self._required.items() if i not in self._staged)
        if missing:
            raise InvalidInput(
                f"sync {version} did not deliver {len(missing)} parameter(s), e.g. {missing[:3]}; "
                "refusing a partial update (the sender's model or payload differs from the receiver's)"
            )
        by_id = {id(p): p for p in self._params.values()}
        with torch.no_grad():
            for pid in self._staged:
                param = by_id[pid]
                old = param.data
                param.data = self._staging[pid]
                self._staging[pid] = old
        self._staged.clear()
        self._active = False

    def abort(self, reason: str) -> None:
        """Forget what was staged (the staging buffers are kept for the next sync)."""
        self._staged.clear()
        self._active = False


class StagingSink:
    """Collects a whole sync as copies, then hands it to ``apply`` on commit.

    ``apply(tensors, header)`` receives the ordered ``{name: tensor}`` of the sync (copies on
    ``device``, default: where they arrived) and the sender's header; it is the place to call an
    inference engine's own loader. Without ``apply`` the last committed sync stays readable as
    ``tensors`` / ``header`` / ``version``. Extra memory: one copy of the sync.
    """

    def __init__(
        self,
        apply: Callable[[dict[str, torch.Tensor], Mapping[str, Any]], None] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        self._apply = apply
        self._device = torch.device(device) if device is not None else None
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_header: Mapping[str, Any] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.header: Mapping[str, Any] = {}
        self.version: int | None = None

    def begin(self, version: int, header: Mapping[str, Any]) -> None:
        """Start a fresh staging dict."""
        self._pending = {}
        self._pending_header = dict(header)

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a copy of ``tensor``."""
        if name in self._pending:
            raise InvalidInput(f"sync delivered {name!r} twice; the sender is broken")
        self._pending[name] = tensor.to(device=self._device or tensor.device, copy=True)

    def commit(self, version: int) -> None:
        """Call ``apply`` with the staged tensors, then publish them as ``tensors``."""
        if self._apply is not None:
            self._apply(self._pending, self._pending_header)
        self.tensors, self.header, self.version = self._pending, self._pending_header, version
        self._pending = {}

    def abort(self, reason: str) -> None:
        """Drop the staged copies."""
        self._pending = {}


class AdapterDirSink(StagingSink):
    """Writes each received LoRA adapter as a peft directory ``root/v{version:08d}``
    (``adapter_model.safetensors`` + ``adapter_config.json``), the format vLLM's ``LoRARequest`` and
    ``PeftModel.from_pretrained`` load, then calls ``on_commit(path, version)``.

    The directory appears atomically (written under a temporary name, then renamed); the newest
    ``keep`` versions are kept. Refuses a sync whose payload is not ``"lora"``.
    """

    def __init__(
        self, root: str | Path, on_commit: Callable[[Path, int], None] | None = None, *, keep: int = 2
    ) -> None:
        super().__init__(device="cpu")
        if keep < 1:
            raise InvalidInput(f"AdapterDirSink keep={keep}: keep at least 1 version")
        self.root = Path(root)
        self._on_commit = on_commit
        self._keep = keep
        self.path: Path | None = None

    def begin(self, version: int, header: Mapping[str, Any]) -> None:
        """Refuse anything but a LoRA payload."""
        if header.get("payload") != "lora" or not isinstance(header.get("adapter_config"), dict):
            raise InvalidInput(
                f"AdapterDirSink needs a LoRA payload with its adapter_config, got payload "
                f"{header.get('payload')!r}; send WeightPayload('lora') from an engine with LoRA"
            )
        super().begin(version, header)

    def commit(self, version: int) -> None:
        """Write the adapter directory, publish it, then call ``on_commit``."""
        from safetensors.torch import save_file

        final = self.root / f"v{version:08d}"
        tmp = self.root / f".v{version:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {n: t.contiguous() for n, t in self._pending.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(self._pending_header["adapter_config"], indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        super().commit(version)
        self.path = final
        old = sorted(p for p in self.root.glob("v*") if p.is_dir())[: -self._keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        if self._on_commit is not None:
            self._on_commit(final, version)
