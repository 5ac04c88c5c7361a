"""``HFRolloutWorker``: a Hugging Face ``transformers`` model in a process of its own, kept in step
with the trainer through the weight-sync receiver.

The trainer-side handle starts the child (``spawn``), which builds the model from its config, connects a
``WeightReceiver`` (colocated: shared memory on cpu, CUDA IPC on cuda; or disaggregated) and serves
requests over a private pipe: ``receive`` (one sync through a ``ModuleSink``), ``generate``, ``logits``,
``state_dict``. Requests are asynchronous where the trainer must work meanwhile: ``start_receive`` then
``sender.sync(engine)`` then ``finish_receive``.
"""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any, Literal

import torch

from underlay.interfaces import ConfigError, UnderlayError

__all__ = ["HFRolloutWorker", "RolloutWorkerError"]


class RolloutWorkerError(UnderlayError, RuntimeError):
    """The rollout worker process failed a request or died; the message carries its traceback."""


def _serve(conn: Any, spec: dict[str, Any]) -> None:
    """Body of the worker process."""
    torch.set_num_threads(int(spec.get("threads", 1)))
    try:
        import transformers

        from underlay.registry import get_device
        from underlay.rollout.sinks import ModuleSink
        from underlay.rollout.transport import WeightReceiver

        device = get_device(spec["device"])
        if device.is_accelerator and spec.get("device_index") is not None:
            device.set_device(int(spec["device_index"]))
        tdev = device.torch_device() if device.is_accelerator else torch.device("cpu")
        auto: Any = transformers.AutoModelForCausalLM
        with tdev:  # initialised where it lives: a 4B model's random init on one cpu thread takes minutes
            model = auto.from_config(
                spec["hf_config"], dtype=spec["dtype"], attn_implementation=spec["attn_implementation"]
            )
        model = model.to(tdev).eval()
        address = (spec["host"], int(spec["port"]))
        if spec["mode"] == "colocated":
            receiver = WeightReceiver.colocated(
                device, address, rank=spec["rank"], timeout_s=spec["timeout_s"]
            )
        else:
            receiver = WeightReceiver.disaggregated(
                device,
                address,
                rank=spec["rank"],
                num_receivers=spec["num_receivers"],
                timeout_s=spec["timeout_s"],
            )
        sink = ModuleSink(model)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:
            break
        try:
            if op == "close":
                receiver.close()
                conn.send(("ok", None))
                break
            if op == "receive":
                result: Any = receiver.receive(sink)
            elif op == "generate":
                device.manual_seed(int(kwargs.pop("seed")))
                with torch.no_grad():
                    ids = kwargs.pop("input_ids").to(tdev)
                    mask = kwargs.pop("attention_mask").to(tdev)
                    result = model.generate(input_ids=ids, attention_mask=mask, **kwargs).cpu()
            elif op == "logits":
                with torch.no_grad():
                    result = model(
                        input_ids=kwargs["input_ids"].to(tdev),
                        attention_mask=kwargs["attention_mask"].to(tdev),
                    ).logits.cpu()
            elif op == "state_dict":
                result = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
            elif op == "state_digest":
                from underlay.rollout.codec import tensor_digest

                result = {n: tensor_digest(p) for n, p in model.state_dict().items()}
            elif op == "version":
                result = receiver.version
            elif op == "num_parameters":
                result = sum(p.numel() for p in model.parameters())
            else:
                raise ConfigError(f"unknown rollout worker request {op!r}")
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class HFRolloutWorker:
    """Trainer-side handle of a rollout worker process holding ``AutoModelForCausalLM.from_config(
    hf_config, dtype=dtype)`` on ``device`` (a registry name; ``device_index`` for accelerators).

    The worker connects to a ``WeightSender`` at ``(host, port)`` (``mode`` colocated or
    disaggregated, receiver ``rank`` of ``num_receivers``): build the sender with ``wait=False``, start
    the worker with ``port=sender.port``, then ``sender.wait_for_receivers()`` (the worker retries
    connecting until ``timeout_s``). Raises ``RolloutWorkerError`` with the child's traceback when the
    child fails.
    """

    def __init__(
        self,
        hf_config: Any,
        *,
        dtype: torch.dtype,
        device: str,
        port: int,
        host: str = "127.0.0.1",
        mode: Literal["colocated", "disaggregated"] = "colocated",
        rank: int = 1,
        num_receivers: int = 1,
        device_index: int | None = None,
        timeout_s: float = 600.0,
        threads: int = 1,
        attn_implementation: str = "sdpa",
    ) -> None:
        if mode not in ("colocated", "disaggregated"):
            raise ConfigError(f"HFRolloutWorker mode={mode!r}: use 'colocated' or 'disaggregated'")
        spec = {
            "hf_config": hf_config,
            "dtype": dtype,
            "device": device,
            "device_index": device_index,
            "host": host,
            "port": port,
            "mode": mode,
            "rank": rank,
            "num_receivers": num_receivers,
            "timeout_s": timeout_s,
            "threads": threads,
            "attn_implementation": attn_implementation,
        }
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, spec), daemon=True, name=f"rollout-worker-{rank}"
        )
        self._proc.start()
        child.close()
        self._pending: str | None = "ready"

    def _reply(self, what: str) -> Any:
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RolloutWorkerError(
                f"rollout worker {self._proc.name} died during {what!r} (exit code {self._proc.exitcode})"
            ) from exc
        self._pending = None
        if status == "error":
            raise RolloutWorkerError(f"rollout worker request {what!r} failed:\n{payload}")
        return payload

    def wait_ready(self) -> None:
        """Block until the worker built its model and connected its receiver."""
        if self._pending == "ready":
            self._reply("ready")

    def _call(self, op: str, **kwargs: Any) -> Any:
        self.wait_ready()
        self._conn.send((op, kwargs))
        return self._reply(op)

    def start_receive(self) -> None:
        """Ask the worker to receive the next sync (returns at once; pair with ``finish_receive``)."""
        self.wait_ready()
        self._conn.send(("receive", {}))
        self._pending = "receive"

    def finish_receive(self) -> int:
        """The version the worker committed; ``RolloutWorkerError`` when its receive failed."""
        return int(self._reply("receive"))

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, seed: int, **kwargs: Any
    ) -> torch.Tensor:
        """``model.generate`` in the worker after ``manual_seed(seed)``; the output ids on the cpu."""
        return self._call("generate", input_ids=input_ids, attention_mask=attention_mask, seed=seed, **kwargs)  # type: ignore[no-any-return]

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The worker model's logits ``[B, S, V]`` on the cpu."""
        return self._call("logits", input_ids=input_ids, attention_mask=attention_mask)  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A cpu copy of the worker model's state dict."""
        return self._call("state_dict")  # type: ignore[no-any-return]

    def state_digest(self) -> dict[str, str]:
        """``codec.tensor_digest`` of every tensor of the worker model's state dict, by name: a
        bit-exactness check of a large model without copying it out of the worker."""
        return self._call("state_digest")  # type: ignore[no-any-return]

    def num_parameters(self) -> int:
        """Parameters of the worker model (tied ones once)."""
        return int(self._call("num_parameters"))

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if self._proc.is_alive():
            try:
                if self._pending is None:
                    self._conn.send(("close", {}))
                    self._conn.recv()
            except (EOFError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
