"""Thin adapters that plug the weight-sync receiver into vLLM and SGLang.

vLLM and SGLang pin torch versions other than underlay's test environment, so these adapters are not
exercised by the test suite. They are deliberately small: everything that can break (framing, version
checks, staging, partial-sync refusal) lives in ``WeightReceiver`` and ``StagingSink``, which are tested;
what remains here is one call into each engine's documented weight-update hook.

vLLM (``LLM(..., worker_extension_cls="underlay.rollout.adapters.VllmWorkerExtension")``; the methods
run inside every vLLM worker through ``LLM.collective_rpc``)::

    # trainer process, per inference engine
    llm.collective_rpc("underlay_connect", args=("10.0.0.1", port, "disaggregated", 1, world_receivers))
    t = threading.Thread(target=llm.collective_rpc, args=("underlay_receive",))
    t.start(); sender.sync(engine); t.join()  # receive blocks until the sync is committed

Each worker stages the full sync (on ``staging_device``, default its GPU) and then calls
``model_runner.model.load_weights(weights=...)``, vLLM's per-model loader, which takes Hugging Face
names, fuses q/k/v and gate/up, shards for tensor parallelism and, for a block-FP8 model
(``quantization="fp8"`` with ``weight_block_size``), accepts FP8 weights with their ``weight_scale_inv``
scales as sent by ``WeightPayload(fp8_block=...)``. LoRA: receive with ``AdapterDirSink`` and generate
with ``LoRARequest(f"v{version}", version, str(path))``.

SGLang (``sglang.Engine`` in the receiving process)::

    receiver = WeightReceiver.disaggregated(get_device(), (host, port), rank=1, num_receivers=1)
    receiver.receive(sglang_sink(engine))   # engine.update_weights_from_tensor(named_tensors, ...)

``Engine.update_weights_from_tensor`` hands the tensors to its tensor-parallel workers (same names
and FP8 rules as vLLM's loader). LoRA: ``AdapterDirSink(root, on_commit=lambda p, v:
engine.load_lora_adapter(f"v{v}", str(p)))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from underlay.rollout.sinks import StagingSink
from underlay.rollout.transport import WeightReceiver

__all__ = ["VllmWorkerExtension", "sglang_sink", "vllm_sink"]


def vllm_sink(model: Any, *, staging_device: torch.device | str | None = None) -> StagingSink:
    """A sink that loads each committed sync with vLLM's ``model.load_weights(weights=...)``
    (``model``: ``worker.model_runner.model``)."""

    def apply(tensors: dict[str, torch.Tensor], header: Mapping[str, Any]) -> None:
        model.load_weights(weights=list(tensors.items()))

    return StagingSink(apply, device=staging_device)


def sglang_sink(engine: Any, *, flush_cache: bool = True) -> StagingSink:
    """A sink that applies each committed sync through SGLang's
    ``Engine.update_weights_from_tensor(named_tensors, flush_cache=...)``."""

    def apply(tensors: dict[str, torch.Tensor], header: Mapping[str, Any]) -> None:
        engine.update_weights_from_tensor(named_tensors=list(tensors.items()), flush_cache=flush_cache)

    return StagingSink(apply)


class VllmWorkerExtension:
    """Mixed into vLLM's GPU worker by ``worker_extension_cls``; call its methods with
    ``LLM.collective_rpc``. ``self.model_runner`` is the vLLM worker's."""

    model_runner: Any
    _underlay_receiver: WeightReceiver | None = None

    def underlay_connect(
        self,
        host: str,
        port: int,
        mode: Literal["colocated", "disaggregated"],
        rank: int,
        num_receivers: int = 1,
        timeout_s: float = 600.0,
    ) -> None:
        """Connect this worker to a ``WeightSender`` at ``host:port`` as receiver ``rank``."""
        from underlay.registry import get_device

        device = get_device()
        if mode == "colocated":
            self._underlay_receiver = WeightReceiver.colocated(
                device, (host, port), rank=rank, timeout_s=timeout_s
            )
        else:
            self._underlay_receiver = WeightReceiver.disaggregated(
                device, (host, port), rank=rank, num_receivers=num_receivers, timeout_s=timeout_s
            )

    def underlay_receive(self, staging_device: str | None = None) -> int:
        """Receive one sync and load it; returns the committed version (``WeightSyncError`` otherwise,
        with the previous weights still live)."""
        if self._underlay_receiver is None:
            from underlay.interfaces import InvalidInput

            raise InvalidInput("call underlay_connect on every worker before underlay_receive")
        return self._underlay_receiver.receive(
            vllm_sink(self.model_runner.model, staging_device=staging_device)
        )
