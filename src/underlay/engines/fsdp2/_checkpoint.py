"""The fsdp2 engine's checkpoints: sharded model and optimizer state with
``torch.distributed.checkpoint`` (loadable at another world size), the LR schedule, ``global_step``
and the model signature that ``load_checkpoint`` checks first."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from underlay.engines._core import (
    LiveState,
    load_transaction,
)
from underlay.engines.fsdp2._optim import FSDP2Optim, _optim_params
from underlay.interfaces import CheckpointError
from underlay.parallel.agree import agreed
from underlay.parallel.rank import current_rank

_STATE_FILE = "engine_state.pt"
_SIGNATURE_FILE = "engine_signature.json"


class FSDP2Checkpoint(FSDP2Optim):
    """Sharded checkpoints (``torch.distributed.checkpoint``) and the model signature."""

    # ------------------------------------------------------------------------------ checkpoints

    def model_signature(self) -> Mapping[str, Any]:
        """Architecture, kind, LoRA rank, and every parameter's engine name and full shape."""
        cfg = self._hf_config
        lora = self._config.model.lora
        return {
            "engine": "fsdp2",
            "architecture": type(cfg).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "kind": self._config.model.kind,
            "lora_rank": lora.rank if lora is not None else None,
            "params": {n: list(p.shape) for n, p in self._model.named_parameters()},
        }

    def save_checkpoint(self, directory: Path) -> None:
        """Sharded model and optimizer state with ``torch.distributed.checkpoint`` (loadable at another
        world size), plus the LR schedule, ``global_step`` and the model signature (rank 0).
        ``directory`` must exist. Collective. ``UnsupportedOperation`` for ``role="reference"`` (no
        training state to save; ``export_hf`` writes its weights)."""
        optimizer = self._trainable("save_checkpoint")
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        self._ensure_onloaded("save_checkpoint")
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"save_checkpoint: {directory} is not an existing directory")
        self._reshard()
        state = {
            "model": get_model_state_dict(self._model),
            "optim": get_optimizer_state_dict(self._model, optimizer),
        }
        try:
            dcp_save(state, checkpoint_id=str(directory))
        except CheckpointException as exc:  # a BaseException: convert so callers can handle it
            raise CheckpointError(
                f"save_checkpoint({directory}): {str(exc).strip().splitlines()[-1]}"
            ) from exc
        # rank 0 writes alone: every rank raises its reason instead of waiting in the next collective
        with agreed(f"save_checkpoint({directory})", error_type=CheckpointError):
            if current_rank() == 0:
                extra = {"global_step": self._global_step, "scheduler": self._scheduler.state_dict()}
                torch.save(extra, directory / _STATE_FILE)
                (directory / _SIGNATURE_FILE).write_text(json.dumps(self.model_signature(), sort_keys=True))

    def check_signature(self, directory: Path) -> None:
        """Raise ``CheckpointError`` unless ``directory`` holds an engine checkpoint of this model
        (same architecture, kind, LoRA rank, parameter names and shapes). Changes nothing."""
        sig_path = Path(directory) / _SIGNATURE_FILE
        if not sig_path.is_file() or not (Path(directory) / _STATE_FILE).is_file():
            raise CheckpointError(
                f"{directory} is not a complete fsdp2 engine checkpoint (missing {_SIGNATURE_FILE} or "
                f"{_STATE_FILE}); pass a directory written by save_checkpoint"
            )
        try:
            saved = json.loads(sig_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{sig_path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
        mine = json.loads(json.dumps(self.model_signature()))
        diff = signature_diff(saved, mine)
        if diff:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another model: {diff}; load it into an engine built "
                "from the same model config"
            )

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what ``save_checkpoint`` wrote, at any world size. The signature is checked first:
        ``CheckpointError`` before any state changes when it belongs to another model or shape.
        ``role="reference"``: the weights (rounded to ``param_dtype``) and ``global_step`` of a trainable
        engine's checkpoint; its optimizer state and LR schedule are not read."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from underlay.utils.safe_dcp import safe_dcp_load

        directory = Path(directory)
        self.check_signature(directory)
        self._ensure_onloaded("load_checkpoint")
        try:
            extra = torch.load(directory / _STATE_FILE, weights_only=True)
            step = extra["global_step"]
            scheduler_state = extra["scheduler"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"global_step={step!r} is not an int >= 0")
            if not isinstance(scheduler_state, dict):
                raise ValueError(f"scheduler state is a {type(scheduler_state).__name__}, not a dict")
        except Exception as exc:
            raise CheckpointError(f"{directory / _STATE_FILE}: unreadable engine state ({exc})") from exc
        self._reshard()
        if self._optimizer is None:
            self._load_reference_weights(directory, step)
            return
        # load into copies: the live weights and optimizer state change only after the whole
        # checkpoint was read (a corrupt shard fails here with the run's state untouched)
        model_sd = _fresh(get_model_state_dict(self._model))
        optim_sd = _fresh(get_optimizer_state_dict(self._model, self._optimizer))
        # a parameter that never had a gradient when the checkpoint was saved (a vision tower in
        # text-only training, an unused expert) has no optimizer state there; torch's template for
        # this engine has one for every parameter: those entries are not read, and dropped after
        stateless = {fqn: optim_sd["state"].pop(fqn) for fqn in _stateless_params(optim_sd, directory)}
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        live = LiveState(
            [*self._model.parameters(), *_optim_params(self._optimizer)], [self._optimizer], [self._scheduler]
        )
        with load_transaction(f"load_checkpoint({directory})", live):
            safe_dcp_load(state, directory)
            set_model_state_dict(self._model, model_sd)
            optim_sd["state"].update(stateless)  # torch's setter wants every parameter's entry
            set_optimizer_state_dict(self._model, self._optimizer, optim_sd)
            params = dict(self._model.named_parameters())
            for fqn in stateless:  # as at save: no state until the parameter's first gradient
                param = params.get(fqn)
                if param is not None:
                    self._optimizer.state.pop(param, None)
            self._scheduler.load_state_dict(scheduler_state)
        self._global_step = step
        self.zero_grad()

    def _load_reference_weights(self, directory: Path, step: int) -> None:
        """``load_checkpoint`` of a reference engine: the checkpoint's fp32 weights are read into fp32
        copies of the shards (no dtype conversion inside the checkpoint reader), then rounded into the
        live ``param_dtype`` weights; a failed read leaves them untouched."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from underlay.utils.safe_dcp import safe_dcp_load

        model_sd = {k: _fresh(v).to(torch.float32) for k, v in get_model_state_dict(self._model).items()}
        live = LiveState(list(self._model.parameters()), [], [])
        with load_transaction(f"load_checkpoint({directory})", live):
            safe_dcp_load({"model": model_sd}, directory)
            set_model_state_dict(self._model, model_sd)
        self._global_step = step


def signature_diff(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """Human-readable first differences between two model signatures ("" when equal)."""
    problems: list[str] = []
    for key in sorted(set(saved) | set(mine)):
        if key == "params":
            continue
        if saved.get(key) != mine.get(key):
            problems.append(f"{key}: checkpoint {saved.get(key)!r} != model {mine.get(key)!r}")
    sp, mp = saved.get("params", {}), mine.get("params", {})
    missing = sorted(set(mp) - set(sp))
    extra = sorted(set(sp) - set(mp))
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:3]}")
    if extra:
        problems.append(f"parameters the model does not have: {extra[:3]}")
    shapes = [f"{n} {sp[n]} != {mp[n]}" for n in sorted(set(sp) & set(mp)) if sp[n] != mp[n]]
    if shapes:
        problems.append(f"shape mismatch: {shapes[:3]}")
    return "; ".join(problems)


def _fresh(tree: Any) -> Any:
    """A copy of a (nested) state dict with every tensor cloned (DTensors stay DTensors)."""
    if torch.is_tensor(tree):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_fresh(v) for v in tree)
    return tree


def _stateless_params(optim_sd: Mapping[str, Any], directory: Path) -> list[str]:
    """The parameter names of ``optim_sd["state"]`` (torch's ``get_optimizer_state_dict`` layout) for
    which the DCP checkpoint in ``directory`` holds no optimizer state."""
    from underlay.utils.safe_dcp import SafeFileSystemReader

    saved = SafeFileSystemReader(str(directory)).read_metadata().state_dict_metadata
    prefixes = {k.rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")}
    return [fqn for fqn in optim_sd.get("state", {}) if f"optim.state.{fqn}" not in prefixes]
