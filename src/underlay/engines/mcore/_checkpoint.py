"""Checkpoints of the mcore engine: megatron's ``dist_checkpointing`` (model and optimizer), the
engine state, the model signature and the all-or-nothing load."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._core import (
    LiveState,
    load_transaction,
)
from underlay.engines.mcore._chunks import torch_optimizers as _torch_optimizers
from underlay.engines.mcore._chunks import unwrap as _unwrap
from underlay.engines.mcore._optim import MCoreOptim
from underlay.engines.mcore.weightmap import hf_shapes
from underlay.interfaces import (
    CheckpointError,
)
from underlay.parallel.rank import current_rank

_STATE_FILE = "engine_state.pt"
_SIGNATURE_FILE = "engine_signature.json"


class MCoreCheckpoint(MCoreOptim):
    """``save_checkpoint``/``load_checkpoint`` at any TP/PP/VPP/DP/CP layout."""

    def model_signature(self) -> Mapping[str, Any]:
        """Architecture, kind, every HF tensor's full shape (layout independent) and, with LoRA, the
        adapters' rank, scale and modules."""
        cfg = self._hf_config
        return {
            "engine": "mcore",
            "architecture": type(cfg).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "kind": self._config.model.kind,
            "params": {n: list(s) for n, s in hf_shapes(self._arch).items()},
            # padded vocabulary rows (a multiple of tp) live in the checkpoint's tensors
            **({"vocab_rows": self._arch.vocab_rows} if self._arch.vocab_rows != self._arch.vocab else {}),
            # LoRA: the adapters live in the checkpoint beside the frozen base
            **(
                {
                    "lora": {
                        "rank": self._lora.rank,
                        "scaling": self._lora.scaling,
                        "modules": list(self._lora.modules),
                    }
                }
                if self._lora is not None
                else {}
            ),
        }

    def _sharded_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for i, c in enumerate(self._chunks):
            key = f"model{i}" if len(self._chunks) > 1 else "model"
            state[key] = _unwrap(c).sharded_state_dict(prefix="")
        return state

    def save_checkpoint(self, directory: Path) -> None:
        """Model parameters and optimizer state through ``megatron.core.dist_checkpointing`` (torch_dist,
        one ``model/`` directory): the optimizer's sharded state dict in megatron's ``fully_reshardable``
        format (distributed optimizer) or per-parameter sharded tensors (plain optimizer), so both load
        at another TP/PP/DP layout; plus the LR schedule, ``global_step``, the layout and the model
        signature. Collective."""
        from megatron.core import dist_checkpointing

        self._ensure_onloaded("save_checkpoint")
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"save_checkpoint: {directory} is not an existing directory")
        (directory / "model").mkdir(exist_ok=True)
        dist.barrier()
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        # the writer forks worker processes per rank when thread_count > 1; those deadlocked in the
        # CPU (gloo) runs, so the host-device case writes from the rank's own process
        threads = 2 if self._device.is_accelerator else 1
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
        self._finish_param_gather()
        self._sync_master_params()
        self._init_optimizer_state()
        state = self._model_state_for_ckpt()
        state["optimizer"] = self._optimizer_sharded_state(state, is_loading=False)
        dist_checkpointing.save(state, str(directory / "model"), sharded_strategy=strategy)
        extra = {
            "global_step": self._global_step,
            "schedulers": [s.state_dict() for s in self._schedulers],
            "layout": self._layout_key(),
            "distributed_optimizer": bool(self._opts.distributed_optimizer),
        }
        torch.save(extra, directory / f"rank{current_rank()}_{_STATE_FILE}")
        if current_rank() == 0:
            (directory / _SIGNATURE_FILE).write_text(json.dumps(self.model_signature(), sort_keys=True))
        dist.barrier()

    def _init_optimizer_state(self) -> None:
        """Give every parameter of the inner torch Adam optimizers its state (``step`` 0, zero moments)
        when it has none yet, as torch's lazy first step would: megatron's sharded optimizer state dict
        reads the state of every parameter (it asserts on an optimizer that never stepped). Changes no
        parameter and no result: a zero-step Adam state is what the first step creates."""
        for opt in _torch_optimizers(self._optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if opt.state.get(p):
                        continue
                    opt.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }

    def _optimizer_sharded_state(self, model_state: dict[str, Any], *, is_loading: bool) -> Any:
        """Megatron's sharded optimizer state over ``model_state`` (the model's sharded state dict that
        is saved or loaded with it): ``fully_reshardable`` for the distributed optimizer (its other
        formats cannot change TP or failed to load in-place without TE/apex). The model entries stay
        nested by chunk (``model0``, ``model1``, ...): megatron walks any structure, and a flat merge
        would let a later virtual chunk's chunk-local keys hide an earlier one's parameters."""
        model_sd = {key: value for key, value in model_state.items() if key.startswith("model")}
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        return self._optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)

    def _model_state_for_ckpt(self) -> dict[str, Any]:
        return self._sharded_state()

    def _refuse_layout(self, directory: Path, extra: Mapping[str, Any]) -> None:
        """``CheckpointError`` for a saved layout that this engine cannot resume exactly, before any
        state changes. Every TP/PP/VPP/DP/CP change resumes exactly (megatron's ``fully_reshardable``
        optimizer format and sharded model tensors). Another ``distributed_optimizer`` setting is
        refused (megatron's formats differ). A MoE model saved at another expert-parallel
        size is refused: megatron keeps the experts in an optimizer of their own only when ep > 1 (its
        ``chained_0``/``chained_1`` state), so the optimizer state does not map across."""
        saved = list(extra.get("layout", []))
        mine = bool(self._opts.distributed_optimizer)
        if extra.get("distributed_optimizer", mine) != mine:
            raise CheckpointError(
                f"load_checkpoint({directory}): saved with distributed_optimizer="
                f"{not mine}, this engine has {mine}: megatron's two optimizers store their state in "
                "formats that do not load into each other; resume with the saving run's setting, or start "
                "from the weights (export_hf, then load_hf) with a fresh optimizer"
            )
        if self._arch.is_moe and len(saved) == 7 and (saved[5] > 1) != (self._layout.ep > 1):
            raise CheckpointError(
                f"load_checkpoint({directory}): saved with expert parallelism ep={saved[5]}, this engine "
                f"has ep={self._layout.ep}: megatron's optimizer keeps experts apart only when ep > 1, "
                "so their optimizer state cannot be resumed across; resume with "
                f"{'ep > 1' if saved[5] > 1 else 'ep=1'}, or start from the weights (export_hf, then "
                "load_hf) with a fresh optimizer"
            )

    def _layout_key(self) -> list[int]:
        lay = self._layout
        return [lay.world_size, lay.tp, lay.pp, self._layout.vpp, lay.cp, lay.ep, self._layout.etp]

    def check_signature(self, directory: Path) -> None:
        """Raise ``CheckpointError`` unless ``directory`` holds an mcore checkpoint of this model."""
        from underlay.engines.mcore._hf import signature_diff

        sig_path = Path(directory) / _SIGNATURE_FILE
        if not sig_path.is_file() or not (Path(directory) / "model").is_dir():
            raise CheckpointError(
                f"{directory} is not a complete mcore engine checkpoint (missing {_SIGNATURE_FILE} or model/); "
                "pass a directory written by save_checkpoint"
            )
        saved = json.loads(sig_path.read_text())
        diff = signature_diff(saved, json.loads(json.dumps(self.model_signature())))
        if diff:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another model: {diff}; load it into an engine built from the same model config"
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the model, the optimizer state (Adam moments and step), the LR schedule and
        ``global_step`` at any TP/PP/DP layout: the next step equals the one the saving run would have
        taken. ``CheckpointError`` before any state changes for another model. Collective."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        self.check_signature(directory)
        self._ensure_onloaded("load_checkpoint")
        self._finish_param_gather()  # a pending gather would overwrite the loaded parameters
        extra = self._read_engine_state(directory)
        live = LiveState(
            [*self._param_tensors(), *self._optim_tensors()],
            _torch_optimizers(self._optimizer),
            self._schedulers,
        )
        # every phase writes live tensors in place (megatron loads into the parameters' own storage):
        # a failure anywhere puts everything back and raises CheckpointError
        with load_transaction(f"load_checkpoint({directory})", live):
            self._init_optimizer_state()
            state = self._model_state_for_ckpt()
            state["optimizer"] = self._optimizer_sharded_state(state, is_loading=True)
            loaded = dist_checkpointing.load(state, str(directory / "model"))
            for i, c in enumerate(self._chunks):
                key = f"model{i}" if len(self._chunks) > 1 else "model"
                _unwrap(c).load_state_dict(loaded[key], strict=False)
            # with fp32 parameters megatron's "main" params are the model params themselves (leaves
            # that require grad): its in-place copies of the loaded state must not be recorded by autograd
            with torch.no_grad(), _step_kept_aside(self._optimizer):
                self._optimizer.load_state_dict(loaded["optimizer"])
            # megatron's distributed optimizer (without apex/TE) restores torch Adam's "step" as ONE
            # tensor shared by every parameter's state; torch's foreach Adam increments each in place,
            # so a shared tensor would advance once per parameter per step: give each its own copy
            for o in _torch_optimizers(self._optimizer):
                for st in o.state.values():
                    if "step" in st:
                        st["step"] = st["step"].clone()
            for s, st in zip(self._schedulers, extra["schedulers"]):
                s.load_state_dict(st)
        self._global_step = int(extra["global_step"])
        self._masters_stale = False
        self.zero_grad()

    def _read_engine_state(self, directory: Path) -> dict[str, Any]:
        """This rank's ``engine_state.pt`` (rank 0's when the saving world was smaller), checked:
        ``CheckpointError`` for an unreadable file, a malformed content, or a layout this engine
        cannot resume exactly (``_refuse_layout``). Changes nothing."""
        path = directory / f"rank{current_rank()}_{_STATE_FILE}"
        if not path.is_file():
            path = directory / f"rank0_{_STATE_FILE}"
        try:
            extra = torch.load(path, weights_only=False)
            step = extra["global_step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"global_step={step!r} is not an int >= 0")
            if len(extra["schedulers"]) != len(self._schedulers):
                raise ValueError(
                    f"{len(extra['schedulers'])} LR schedules saved, this engine has {len(self._schedulers)}"
                )
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable engine state ({type(exc).__name__}: {exc})") from exc
        self._refuse_layout(directory, extra)
        return dict(extra)


@contextlib.contextmanager
def _step_kept_aside(opt: Any) -> Iterator[None]:
    """While loading a ``fully_reshardable`` state into megatron's distributed optimizer without
    TE/apex: its per-parameter setter copies every key of torch Adam's state from the loaded tensors,
    but the loaded per-parameter tensors have no ``step`` (it travels in the param groups and was
    already restored), so it raises ``KeyError: 'step'``. Each call sets the parameter's ``step``
    aside and puts it back afterwards; the setter is restored on exit."""
    patched = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        setter = getattr(o, "_set_main_param_and_optimizer_states", None)
        index = getattr(o, "model_param_group_index_map", None)
        if setter is None or index is None:
            continue

        def kept(model_param: Any, tensors: Any, o: Any = o, setter: Any = setter) -> None:
            group, order = o.model_param_group_index_map[model_param]
            state = o.optimizer.state[o.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                setter(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        o._set_main_param_and_optimizer_states = kept
        patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states
