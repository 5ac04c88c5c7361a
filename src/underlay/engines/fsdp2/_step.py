"""The fsdp2 engine's compute: batches validated and planned into micro-batches, the packed (or
shared-prompt) forward, ``forward_backward`` with its gradient sync and failure recovery, ``infer``."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._core import (
    check_token_batch,
    report_nonfinite,
)
from underlay.engines._loss import MetricReducer, check_loss_fn, checked_loss, count_loss
from underlay.engines.fsdp2._grad_sync import _fill_late_accumulators, _unfill, _ZeroFilled
from underlay.engines.fsdp2._optim import FSDP2Optim
from underlay.interfaces import (
    InvalidInput,
    LossFn,
    StepResult,
    TokenBatch,
    TokenOutputs,
)


class FSDP2Step(FSDP2Optim):
    """Batches: validation, micro-batch plans, the packed forward, ``forward_backward`` and ``infer``."""

    # --------------------------------------------------------------------------------- compute

    def _check_batch(self, batch: TokenBatch) -> TokenBatch:
        """``batch`` validated (``_core.check_token_batch``, then the vision inputs) and on the device;
        ``InvalidInput`` before any state changes."""
        check_token_batch(batch, int(getattr(self._hf_config, "vocab_size", 0) or 0), shared_prompts=True)
        from underlay.models import check_vision_batch

        check_vision_batch(self._hf_config, batch)
        if batch.prompt_groups is not None:
            from underlay.models.shared_prompts import check_shared_prompts

            if self._ulysses_group is not None:
                raise InvalidInput(
                    f"TokenBatch.prompt_groups with Ulysses (ulysses={self._layout.ulysses}): shared prompts "
                    "need each group's whole stream on one rank; give the batch without prompt_groups"
                )
            check_shared_prompts(self._model)
        return batch.to(self._torch_device)

    def _plan(self, batch: TokenBatch) -> list[list[int]]:
        from underlay.models import sequence_costs
        from underlay.ops import plan_micro_batches

        if batch.prompt_groups is not None:  # whole groups, each costing the tokens it computes shared
            from underlay.ops.prompt_sharing import shared_prompt_costs

            rows_of, costs = shared_prompt_costs(batch.input_ids, batch.attention_mask, batch.prompt_groups)
            big = max(range(len(costs)), key=costs.__getitem__)
            if costs[big] > self._config.micro_batch_max_tokens:
                raise InvalidInput(
                    f"TokenBatch.prompt_groups: the group of rows {rows_of[big]} computes {costs[big]} tokens "
                    f"shared > micro_batch_max_tokens={self._config.micro_batch_max_tokens} (a group stays in "
                    "one micro-batch); raise micro_batch_max_tokens or give the batch without prompt_groups"
                )
            plan = plan_micro_batches(costs, self._config.micro_batch_max_tokens, group=self._dp_group)
            return [[r for g in mb for r in rows_of[g]] for mb in plan]
        # tokens, plus the vision patches of a row's images weighted by models.patch_cost
        seqlens = sequence_costs(self._hf_config, batch)
        return plan_micro_batches(seqlens, self._config.micro_batch_max_tokens, group=self._dp_group)

    def _forward(self, batch: TokenBatch, temperature: float, with_entropy: bool) -> TokenOutputs:
        """Packed forward of one micro-batch (shared prompts with ``prompt_groups``); outputs padded
        back to ``[b, S]``."""
        from underlay.models import packed_forward
        from underlay.ops import pad, unpad

        if batch.prompt_groups is not None:
            from underlay.models.shared_prompts import shared_prompt_forward
            from underlay.ops.prompt_sharing import share_prompts

            shared = share_prompts(batch.input_ids, batch.attention_mask, batch.prompt_groups)
            packed = shared.packed
            with self._compile_scope():
                out = shared_prompt_forward(
                    self._model,
                    shared,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    logprob_kernel=self._logprob_kernel,
                )
            return TokenOutputs(
                *(None if t is None else pad(t, packed) for t in (out.log_probs, out.entropy, out.values))
            )
        packed = unpad(batch.input_ids, batch.attention_mask)
        multimodal, zero_passes = self._vision_inputs(batch)
        with self._compile_scope():  # AOTAutograd partitions forward/backward when forward compiles
            out = packed_forward(
                self._model,
                packed,
                temperature=temperature,
                with_entropy=with_entropy,
                logprob_kernel=self._logprob_kernel,
                sp_group=self._ulysses_group,
                multimodal=multimodal,
                zero_vision_passes=zero_passes,
            )

        def back(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else pad(t, packed)

        return TokenOutputs(back(out.log_probs), back(out.entropy), back(out.values), out.aux_loss)

    def _vision_inputs(self, batch: TokenBatch) -> tuple[dict[str, torch.Tensor] | None, int]:
        """A vision-language micro-batch's ``multimodal`` inputs, and how many zero-weight vision
        passes this rank adds: the vision blocks are FSDP units, so every rank runs the tower as many
        times as the rank with the most (images: one run, videos: another; agreed by one all-reduce
        over the world per micro-batch, only for VLMs on more than one rank)."""
        from underlay.models import is_vision_config, multimodal_inputs, vision_calls

        if not is_vision_config(self._hf_config):
            return None, 0
        calls = vision_calls(batch)
        most = calls
        if self._layout.world_size > 1:
            agreed_calls = torch.tensor([calls], dtype=torch.int64, device=self._torch_device)
            dist.all_reduce(agreed_calls, op=dist.ReduceOp.MAX)
            most = int(agreed_calls.item())
        return multimodal_inputs(batch), most - calls

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Accumulate gradients of the sum of ``loss_fn``'s contributions over ``batch`` (this rank's
        share; loss contract v3, ``interfaces.LossFn``).

        Micro-batches come from ``ops.plan_micro_batches`` (same count on every dp rank); each is
        packed, run through ``models.packed_forward``, padded back and handed to ``loss_fn`` with its
        ``LossContext`` (global counts once per Ulysses group, ``engines._loss``). Every contribution
        is scaled by ``world_size`` before backward, which undoes FSDP's mean over ranks: gradients sum
        over micro-batches and dp ranks. Metrics reduce as declared (``"loss"``: the sum of the
        contributions).

        Gradient sync (``options.grad_sync``): ``"per_micro_batch"`` reduce-scatters each micro-batch's
        gradients into the sharded ones; ``"per_step"`` only at the last micro-batch (FSDP2 accumulates
        the unsharded gradients in the reduce dtype until then), when the plan has more than one
        micro-batch and no gradients are pending from an earlier call before the optimizer step (that
        call then syncs per micro-batch, so unsharded and sharded gradients never add up). The same
        gradients up to floating-point summation order. An exception leaves no gradient behind (the
        earlier calls' included), resets FSDP's per-iteration state and restores gradient sync."""
        self._trainable("forward_backward")
        check_loss_fn(loss_fn)
        self._ensure_adapters_on()
        batch = self._check_batch(batch)
        self._ensure_onloaded("forward_backward")
        dp_group = self._dp_group
        counts = count_loss(batch.loss_mask, dp_group, self._layout.dp, self._torch_device)
        reducer = MetricReducer(self._torch_device)
        scale = self._layout.world_size  # FSDP averages gradients over every rank: sum instead
        plan = self._plan(batch)
        from underlay.models.randomness import set_training_mode

        set_training_mode(self._model, self._config.model.training_randomness)
        # the same on every rank: the plan has as many micro-batches on every dp rank, and the
        # pending flag follows the calls, which are collective
        sync_once = self._options.grad_sync == "per_step" and len(plan) > 1 and not self._grads_pending
        completed = False
        filled: list[_ZeroFilled] = []
        warm = self._compile_warmup.start() if self._options.compile else None
        if self._single is not None:  # the compute copies stay in for backward and recomputation
            self._single.swap_in()
        try:
            for i, idx in enumerate(plan):
                last = i == len(plan) - 1
                # with reshard_after_forward=False the parameters are unsharded for the whole
                # micro-batch anyway: keep them so until the last backward (no all-gather per micro-batch)
                self._set_reshard_after_backward(not self._keep_unsharded or last)
                if sync_once:
                    self._set_requires_gradient_sync(last)
                    if last:
                        filled = _fill_late_accumulators(self._model)
                if not idx:
                    self._dummy_backward(batch)
                    continue
                sub = batch.select(idx)
                outputs = self._forward(sub, self._config.temperature, self._config.with_entropy)
                ctx = counts.context(i, len(plan), idx, sub.loss_mask)
                loss, metrics = checked_loss(loss_fn(outputs, sub, ctx))
                (loss * scale).backward()  # type: ignore[no-untyped-call]
                reducer.add(loss, metrics)
            completed = True
        finally:
            if self._single is not None:
                self._single.swap_out()
            _unfill(filled, completed)
            if sync_once:
                self._set_requires_gradient_sync(True)  # after a failure too: the next call syncs
            if not completed:
                # a failed micro-batch must not leak the earlier ones' gradients into the next step
                self._drop_unreduced_grads()
                self.zero_grad()
            if self._keep_unsharded:
                self._set_reshard_after_backward(True)
                self._reshard()  # after a failed micro-batch too: the optimizer works on the shards
        self._grads_pending = True
        if warm is not None:
            self._compile_warmup.stop(warm, self._global_step, self._compile_auto)
        metrics_out = reducer.reduce(dp_group, self._layout.dp)
        if report_nonfinite("forward_backward", metrics_out, reducer.local(), self._torch_device):
            self._skip_next = True
        return StepResult(metrics_out, len(plan), counts.global_tokens, counts.global_sequences)

    def _dummy_backward(self, batch: TokenBatch) -> None:
        """This rank has no sequence for a micro-batch that other dp ranks run: take part in FSDP's
        collectives with a one-token forward whose loss is multiplied by zero."""
        from underlay.models import is_vision_config

        sub = batch.select([0])
        ids = sub.input_ids[:, :1]
        if is_vision_config(self._hf_config):  # token 0, never an image placeholder without its image
            ids = torch.zeros_like(ids)
        one = TokenBatch(
            ids,
            torch.ones_like(sub.attention_mask[:, :1]),
            torch.zeros_like(sub.loss_mask[:, :1]),
        )
        out = self._forward(one, self._config.temperature, False)
        tensor = out.values if out.values is not None else out.log_probs
        assert tensor is not None
        (tensor.sum() * 0.0).backward()  # type: ignore[no-untyped-call]

    @torch.no_grad()
    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """Per-token log-probs (causal LM; entropy when ``with_entropy``) or values (value model),
        ``[B, S]`` fp32 on the device, rows in the order of ``batch``; 0 at position 0 and padding."""
        batch = self._check_batch(batch)
        self._ensure_onloaded("infer")
        temp = self._config.temperature if temperature is None else temperature
        ok = isinstance(temp, (int, float)) and not isinstance(temp, bool)
        if not (ok and math.isfinite(temp) and temp > 0):
            raise InvalidInput(f"infer: temperature={temp!r} must be a finite number > 0")
        self._model.eval()
        shape = tuple(batch.input_ids.shape)
        result: dict[str, torch.Tensor] = {}
        warm = self._compile_warmup.start() if self._options.compile else None
        for idx in self._plan(batch):
            if not idx:
                self._forward(batch.select([0]), temp, False)
                continue
            with self._compute_view():
                out = self._forward(batch.select(idx), temp, with_entropy)
            rows = torch.as_tensor(idx, device=self._torch_device)
            for key in ("log_probs", "entropy", "values"):
                t = getattr(out, key)
                if t is not None:
                    buf = result.setdefault(
                        key, torch.zeros(shape, dtype=torch.float32, device=self._torch_device)
                    )
                    buf[rows] = t.to(torch.float32)
        self._reshard()
        if warm is not None:  # inference compiles its own (no-grad) graphs once too
            self._compile_warmup.stop(warm, self._global_step, self._compile_auto)
        return TokenOutputs(result.get("log_probs"), result.get("entropy"), result.get("values"))

    def _compute_view(self) -> contextlib.AbstractContextManager[Any]:
        """World size 1 (``options.single_device``): the modules hold the compute-dtype copies inside
        (``single.ComputeCopy``); under FSDP2 nothing to do."""
        return self._single.compute_view() if self._single is not None else contextlib.nullcontext()
