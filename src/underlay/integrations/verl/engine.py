"""verl ``BaseEngine`` implementations that delegate to an underlay ``ParallelEngine``.

The batch contract is that of verl 0.9.1's own FSDP engine (``verl/workers/engine/fsdp``) in its
``NO_PADDING`` mode: ``input_ids`` and ``position_ids`` are jagged nested tensors ``[b, j]``, the loss
fields (``prompts``, ``responses``, ``response_mask``, ``old_log_probs``, ``advantages``, ...) ride along,
and non-tensor entries (``temperature``, ``calculate_entropy``, ``global_batch_size``, ...) steer the
call. Outputs are verl's: ``model_output`` holds jagged ``log_probs``/``entropy`` (policy) or ``values``
(critic) ``[b, j]`` where position ``t`` belongs to the prediction made at token ``t`` (log-prob of
token ``t + 1``; 0 at each sequence's last position, which verl's losses never read), ``loss`` one
float per micro-batch and ``metrics`` a list per key.

Losses are verl's, called unchanged as ``loss_function(model_output=, data=, dp_group=)`` on each
micro-batch with the fields verl's engine sets (``dp_size``, ``batch_num_tokens``): verl's losses scale
their global-batch aggregation by ``dp_size`` because FSDP averages gradients over ranks; underlay's
loss contract sums contributions over ranks, so each one is divided by ``dp_size`` before backward,
which gives exactly the gradient verl's engine computes, in every ``loss_agg_mode``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from underlay.integrations.verl.config import to_underlay_config
from underlay.interfaces import (
    ConfigError,
    InvalidInput,
    LossContext,
    ParallelLayout,
    TokenBatch,
    TokenOutputs,
)

__all__ = ["UnderlayLMEngine", "UnderlayValueEngine", "to_token_batch", "to_verl_outputs"]

ROW_KEY = "verl_row"
"""``TokenBatch.extras`` key holding each row's index in the verl batch (micro-batches select rows)."""


def _lengths(nested: torch.Tensor, what: str) -> torch.Tensor:
    if not (isinstance(nested, torch.Tensor) and nested.is_nested):
        raise InvalidInput(
            f"verl batch field {what!r} is a {type(nested).__name__}, not a jagged nested tensor: convert the "
            "batch with verl.workers.utils.padding.left_right_2_no_padding (pad_mode NO_PADDING)"
        )
    offsets: torch.Tensor = nested.offsets()  # type: ignore[attr-defined]
    return offsets.diff()


def to_token_batch(data: TensorDict) -> TokenBatch:
    """The ``TokenBatch`` of a verl ``NO_PADDING`` batch: ``input_ids`` right-padded ``[B, S]`` int64
    (``S``: the longest sequence), ``attention_mask`` over each sequence's length, ``loss_mask`` the
    tokens whose log-prob verl's losses read (response tokens where ``response_mask`` is 1 when the
    batch has ``prompts``/``responses``; otherwise verl's full-length ``loss_mask``), and
    ``extras[ROW_KEY]`` the row indices. ``InvalidInput`` for a padded (non-nested) batch or ragged
    fields that disagree in length."""
    ids = data["input_ids"]
    lengths = _lengths(ids, "input_ids").to(torch.long)
    b = int(lengths.numel())
    width = int(lengths.max())
    padded = torch.nested.to_padded_tensor(ids, 0, output_size=(b, width)).to(torch.long)
    positions = torch.arange(width, device=padded.device)
    attention = (positions.unsqueeze(0) < lengths.to(padded.device).unsqueeze(1)).to(torch.long)
    if "responses" in data and "response_mask" in data:
        responses = data["responses"]
        if responses.is_nested:
            resp_len = _lengths(responses, "responses").to(padded.device)
        else:  # verl keeps prompts/responses padded beside the nested input_ids (no_padding_2_padding's rule)
            resp_len = data["attention_mask"][:, data["prompts"].shape[1] :].sum(1).to(padded.device)
        start = lengths.to(padded.device) - resp_len
        mask = data["response_mask"]
        rw = int(resp_len.max())
        resp = (
            torch.nested.to_padded_tensor(mask, 0, output_size=(b, rw)).to(torch.long)
            if mask.is_nested
            else mask
        )
        rel = positions.unsqueeze(0) - start.unsqueeze(1)
        inside = (rel >= 0) & (rel < resp_len.unsqueeze(1))
        gathered = torch.gather(resp, 1, rel.clamp(0, max(rw - 1, 0)))
        loss = torch.where(inside, gathered, torch.zeros_like(gathered))
    elif "loss_mask" in data:
        lm = data["loss_mask"]
        if not torch.equal(_lengths(lm, "loss_mask").to(lengths.device), lengths):
            raise InvalidInput("verl batch: loss_mask and input_ids have different sequence lengths")
        loss = torch.nested.to_padded_tensor(lm, 0, output_size=(b, width)).to(torch.long)
    else:
        loss = attention.clone()
    rows = torch.arange(b, device=padded.device)
    return TokenBatch(padded, attention, loss * attention, {ROW_KEY: rows})


def to_verl_outputs(
    out: TokenOutputs, attention_mask: torch.Tensor, want_entropy: bool
) -> dict[str, torch.Tensor]:
    """verl's ``model_output`` (jagged ``[b, j]``) from underlay's ``[b, S]`` outputs: ``values`` as they
    are (the head at each token), ``log_probs``/``entropy`` moved one position left (verl's position
    ``t`` predicts token ``t + 1``). Differentiable; one gather of the kept positions."""
    keep = attention_mask.bool()
    offsets = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])

    def jag(t: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(t[keep], offsets)

    def left(t: torch.Tensor) -> torch.Tensor:
        # underlay holds 0 at padding, so each row's last real position receives 0
        return torch.cat([t[:, 1:], t.new_zeros(t.shape[0], 1)], dim=1)

    result: dict[str, torch.Tensor] = {}
    if out.values is not None:
        result["values"] = jag(out.values)
        return result
    if out.log_probs is None:
        raise InvalidInput("underlay returned neither log-probs nor values")
    result["log_probs"] = jag(left(out.log_probs))
    if want_entropy:
        if out.entropy is None:
            raise InvalidInput("calculate_entropy=True but the underlay engine computed no entropy")
        result["entropy"] = jag(left(out.entropy))
    return result


def _temperature(data: TensorDict) -> float | None:
    """The batch's single sampling temperature (``None`` when absent); ``InvalidInput`` for per-row
    temperatures that differ (underlay computes a micro-batch at one temperature)."""
    if "temperature" not in data:
        return None
    t = data["temperature"]
    if isinstance(t, torch.Tensor):
        flat = t.values() if t.is_nested else t.reshape(-1)
        if flat.numel() == 0:
            return None
        if not bool((flat == flat.reshape(-1)[0]).all()):
            raise InvalidInput(
                "verl batch has per-row temperatures that differ; the underlay backend uses one"
            )
        return float(flat.reshape(-1)[0])
    return float(tu.get_non_tensor_data(data=data, key="temperature", default=1.0))


class UnderlayEngine(BaseEngine):  # type: ignore[misc]
    """A verl engine backed by ``underlay.get_engine``: see the module docstring for the batch contract.

    Built from verl's four configs (``to_underlay_config`` maps them and refuses by name what it cannot
    honour); ``initialize()`` builds the underlay engine (collective). Needs an initialised
    ``torch.distributed`` process group, as verl's engines do.
    """

    model_type = "language_model"

    def __init__(
        self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError(
                "the underlay verl engine needs torch.distributed initialised (verl's workers do it)"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode: str | None = None
        self.underlay_config, self.underlay_engine_name = to_underlay_config(
            model_config,
            engine_config,
            optimizer_config,
            checkpoint_config,
            self.model_type,
            dist.get_world_size(),
        )
        self._engine: Any = None
        self._solo: Any = None
        self._lora = self.underlay_config.model.lora is not None
        self._planned_asked = False

    # ---- construction, modes, parallel groups -------------------------------------------------

    def initialize(self) -> None:
        """Build the underlay engine (loads ``model_config.local_path``); collective."""
        from underlay import get_engine

        self._engine = get_engine(self.underlay_config, self.underlay_engine_name)
        self._solo = None
        if self._engine.layout.groups.dp is None and dist.get_world_size() > 1:
            # one data-parallel rank per model replica (e.g. all ranks in one Ulysses group): verl's
            # losses get a group of this rank alone, not the world
            self._solo, _ = dist.new_subgroups(group_size=1)  # type: ignore[no-untyped-call]
        self._check_planned()
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to(
                "cpu",
                model=self.is_param_offload_enabled,
                optimizer=self.is_optimizer_offload_enabled,
                grad=self.is_param_offload_enabled,
            )

    @property
    def underlay(self) -> Any:
        """The underlying underlay ``ParallelEngine``; ``InvalidInput`` before ``initialize()``."""
        if self._engine is None:
            raise InvalidInput("call initialize() first: the underlay engine is built there")
        return self._engine

    @property
    def is_param_offload_enabled(self) -> bool:
        """``engine_config.param_offload``."""
        return bool(getattr(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """``engine_config.optimizer_offload``."""
        return bool(getattr(self.engine_config, "optimizer_offload", False))

    def train_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """verl's train-mode context (onload/offload per the offload flags)."""
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """verl's eval-mode context (onload/offload per the offload flags)."""
        return BaseEngineCtx(self, "eval", **kwargs)

    def _planned(self) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, is_mp_src)`` from the configured sizes, before the engine exists: verl's
        ``TrainingWorker.__init__`` registers its dispatch ranks before it calls ``initialize()``.
        Exact for data parallel and Ulysses (an underlay Ulysses group is ``ulysses`` consecutive
        ranks that share one data shard); ``InvalidInput`` with tp/pp/cp > 1, whose rank order is the
        engine's own."""
        p = self.underlay_config.parallel
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = ParallelLayout.infer(
            world, tp=p.tp, pp=p.pp, cp=p.cp, ulysses=p.ulysses, dp_replicate=p.dp_replicate
        )
        if layout.mp != layout.ulysses:
            raise InvalidInput(
                f"data-parallel rank asked before initialize() with tp={p.tp}, pp={p.pp}, cp={p.cp}: the "
                "rank order is the engine's; call initialize() first (verl's TrainingWorker asks in its "
                "constructor, so it runs data parallel and Ulysses only)"
            )
        return rank // layout.ulysses, layout.dp, rank % layout.ulysses == 0

    def _check_planned(self) -> None:
        """After ``initialize()``: the engine's ranks equal the answers :meth:`_planned` gave."""
        if not self._planned_asked:
            return
        built = (
            self.get_data_parallel_rank(),
            self.get_data_parallel_size(),
            self.is_mp_src_rank_with_outputs(),
        )
        if built != self._planned():
            raise InvalidInput(
                f"the engine's (dp_rank, dp_size, is_mp_src) {built} differ from those reported before "
                f"initialize() {self._planned()}; verl dispatched data by the latter"
            )

    def get_data_parallel_size(self) -> int:
        """Ranks with different data (``layout.dp``); before ``initialize()`` from the configured sizes."""
        if self._engine is None:
            self._planned_asked = True
            return self._planned()[1]
        return int(self.underlay.layout.dp)

    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group; before ``initialize()`` from the sizes."""
        if self._engine is None:
            self._planned_asked = True
            return self._planned()[0]
        group = self.underlay.layout.groups.dp
        return 0 if group is None else int(dist.get_rank(group))

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group (a group of this rank alone when the engine has one
        data-parallel rank over several processes; the world when there is one process)."""
        group = self.underlay.layout.groups.dp
        if group is not None:
            return group
        return self._solo if self._solo is not None else dist.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Whether this rank is the first of its model-parallel group (every rank holds the outputs);
        before ``initialize()`` from the configured sizes."""
        if self._engine is None:
            self._planned_asked = True
            return self._planned()[2]
        group = self.underlay.layout.groups.mp
        return group is None or dist.get_rank(group) == 0

    # ---- training -------------------------------------------------------------------------------

    def optimizer_zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.underlay.zero_grad()

    def optimizer_step(self) -> float:
        """Clip to ``optim.clip_grad`` and step (a non-finite norm skips the update); the grad norm."""
        return float(self.underlay.optimizer_step().grad_norm)

    def lr_scheduler_step(self) -> float:
        """Advance the schedule; the new learning rate."""
        return float(self.underlay.lr_scheduler_step())

    def _prepare(self, data: TensorDict) -> tuple[TokenBatch, bool, bool]:
        pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise InvalidInput(
                f"verl batch pad_mode={pad_mode!r}: the underlay backend takes NO_PADDING, as verl's engines do"
            )
        for flag in ("distillation_use_topk", "calculate_sum_pi_squared"):
            if tu.get_non_tensor_data(data=data, key=flag, default=False):
                raise InvalidInput(f"verl batch flag {flag}=True is not supported by the underlay backend")
        temp = _temperature(data)
        if temp is not None and temp != self.underlay_config.temperature:
            raise InvalidInput(
                f"verl batch temperature {temp} != the underlay engine's {self.underlay_config.temperature}: set "
                "UnderlayEngineConfig.temperature to the rollout temperature"
            )
        batch = to_token_batch(data)
        want_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        keep_outputs = bool(tu.get_non_tensor_data(data=data, key="return_model_output", default=False))
        return batch, want_entropy, keep_outputs

    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable[..., Any] | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """verl's ``forward_backward_batch``: ``{"model_output", "loss", "metrics"}`` as verl's engines
        return them. Training: every micro-batch's verl loss divided by ``dp_size`` is its contribution
        (module docstring); ``model_output`` is kept only with ``return_model_output``. Forward-only: one
        no-grad pass, outputs in the batch's order, and ``loss_function`` (if any) on the whole batch."""
        batch, want_entropy, keep_outputs = self._prepare(data)
        group = self.get_data_parallel_group()
        dp_size = self.get_data_parallel_size()
        count = data["loss_mask"].sum() if "loss_mask" in data else batch.loss_mask.sum()
        count = count.to(torch.float64).reshape(1)
        if dp_size > 1:
            dist.all_reduce(count, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=int(count.item()), dp_size=dp_size)
        tu.assign_non_tensor(data, sp_size=int(self.underlay.layout.ulysses))
        losses: list[float] = []
        metrics: dict[str, list[Any]] = {}
        if forward_only:
            temp = _temperature(data) or self.underlay_config.temperature
            out = self.underlay.infer(batch, temperature=temp, with_entropy=want_entropy)
            model_output = to_verl_outputs(out, batch.attention_mask, want_entropy)
            if loss_function is not None:
                loss, m = loss_function(model_output=model_output, data=data, dp_group=group)
                losses.append(float(loss.detach().item()))
                append_to_dict(metrics, m)
            return {"model_output": model_output, "loss": losses, "metrics": metrics}
        if loss_function is None:
            raise InvalidInput("forward_backward_batch(forward_only=False) needs a loss_function")
        kept: dict[int, dict[str, torch.Tensor]] = {}

        def loss_fn(
            outputs: TokenOutputs, sub: TokenBatch, ctx: LossContext
        ) -> tuple[torch.Tensor, Mapping[str, Any]]:
            rows = sub.extras[ROW_KEY].cpu()
            micro = tu.index_select_tensor_dict(data, rows)
            model_output = to_verl_outputs(outputs, sub.attention_mask, want_entropy)
            loss, m = loss_function(model_output=model_output, data=micro, dp_group=group)
            losses.append(float(loss.detach().item()))
            append_to_dict(metrics, m)
            if keep_outputs:
                for i, r in enumerate(rows.tolist()):
                    kept[r] = {k: v.detach()[i] for k, v in model_output.items()}
            # verl's loss is its micro-batch's share times dp_size (FSDP averages over ranks); loss
            # contract v3 sums contributions over ranks
            return loss / dp_size, {}

        self.underlay.forward_backward(batch, loss_fn)
        out_model: dict[str, torch.Tensor] = {}
        if keep_outputs and kept:
            for key in next(iter(kept.values())):
                out_model[key] = torch.nested.as_nested_tensor(
                    [kept[r][key] for r in range(batch.batch_size)], layout=torch.jagged
                )
        return {"model_output": out_model, "loss": losses, "metrics": metrics}

    # ---- weights, offload, checkpoints ----------------------------------------------------------

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        """Full tensors with Hugging Face names, one at a time (``engine.iter_weights``, in the
        engine's ``param_dtype``; LoRA adapters merged), and ``None`` (no separate peft config).
        Collective: every rank consumes the generator."""

        def gen() -> Generator[tuple[str, torch.Tensor], None, None]:
            for bucket in self.underlay.iter_weights():
                yield from bucket

        return gen(), None

    def get_per_tensor_param_shard(self, **kwargs: Any) -> Any:
        """Refused (``ConfigError``): verl's sharded/delta checkpoint engines read FSDP DTensor shards;
        the underlay backend streams full tensors (``get_per_tensor_param``)."""
        raise ConfigError(
            "get_per_tensor_param_shard: the underlay backend streams full tensors only; use a full-tensor "
            "checkpoint engine (rollout.checkpoint_engine.backend other than the delta/sharded ones)"
        )

    def get_per_tensor_param_delta_shard(self, **kwargs: Any) -> Any:
        """Refused (``ConfigError``), as :meth:`get_per_tensor_param_shard`."""
        return self.get_per_tensor_param_shard(**kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """``"cpu"``: ``offload`` the chosen state; any other device: ``onload`` it (bit-identical)."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if device == "cpu":
            self.underlay.offload(params=model, grads=grad, optimizer=optimizer)
        else:
            self.underlay.onload(params=model, grads=grad, optimizer=optimizer)

    def _manager(self, local_path: str, keep: int | None) -> Any:
        from underlay.checkpoint import CheckpointManager

        return CheckpointManager(
            local_path, self.underlay, max_to_keep=keep if keep and keep > 0 else 1 << 30
        )

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Crash-safe checkpoint of model, optimizer and schedule into ``local_path/step_<global_step>``
        (``underlay.checkpoint.CheckpointManager``; keeps ``max_ckpt_to_keep`` there). ``hdfs_path`` is
        refused (``InvalidInput``): copy the directory with your own tooling."""
        if hdfs_path is not None:
            raise InvalidInput(
                f"save_checkpoint(hdfs_path={hdfs_path!r}): the underlay backend writes local paths only"
            )
        self._manager(local_path, max_ckpt_to_keep).save(int(global_step), {"global_step": int(global_step)})

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """Restore the newest complete checkpoint under ``local_path`` (or ``local_path`` itself when it
        is a ``step_<k>`` directory). ``CheckpointError`` when there is none or it does not match the
        model, before any state changes. ``del_local_after_load`` only concerns hdfs copies: ignored."""
        if hdfs_path is not None:
            raise InvalidInput(
                f"load_checkpoint(hdfs_path={hdfs_path!r}): the underlay backend reads local paths only"
            )
        path = Path(local_path)
        if path.name.startswith("step_"):
            self._manager(str(path.parent), None).load(path)
        else:
            self._manager(local_path, None).load()

    def disable_adapter(self) -> contextlib.AbstractContextManager[Any]:
        """verl's reference policy under LoRA: the underlay engine's ``disable_adapter()`` (``infer``
        gives the base model's outputs inside it; training inside it raises ``InvalidInput``). Without
        adapters a no-op context, as verl's engines give."""
        if not self._lora:
            return contextlib.nullcontext()
        return cast("contextlib.AbstractContextManager[Any]", self.underlay.disable_adapter())


@EngineRegistry.register(model_type="language_model", backend="underlay", device=["cpu", "cuda", "npu"])
class UnderlayLMEngine(UnderlayEngine):
    """Policy/reference engine: log-probs and entropy in verl's layout."""

    model_type = "language_model"


@EngineRegistry.register(model_type="value_model", backend="underlay", device=["cpu", "cuda", "npu"])
class UnderlayValueEngine(UnderlayEngine):
    """Critic engine: per-token values in verl's layout."""

    model_type = "value_model"
