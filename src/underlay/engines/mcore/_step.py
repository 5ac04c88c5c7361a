"""Batches and compute of the mcore engine: validation, micro-batch planning and THD packing (with
context parallelism), megatron's pipeline schedules, ``forward_backward`` and ``infer``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from underlay.engines._core import (
    check_token_batch,
    report_nonfinite,
)
from underlay.engines._loss import MetricReducer, check_loss_fn, checked_loss, count_loss
from underlay.engines.mcore._chunks import unwrap as _unwrap
from underlay.engines.mcore._optim import MCoreOptim
from underlay.engines.mcore.config import (
    check_interleaved_count,
)
from underlay.engines.mcore.context_parallel import CPSplit
from underlay.interfaces import (
    IGNORE_INDEX,
    InvalidInput,
    LossFn,
    StepResult,
    TokenBatch,
    TokenOutputs,
)
from underlay.parallel.agree import shared_failure


@dataclass
class _MicroBatch:
    """One packed micro-batch as every pipeline chunk sees it."""

    sub: TokenBatch | None  # None: a one-token dummy for a rank without a sequence in this slot
    packed: Any
    input_ids: torch.Tensor  # [1, T'] (T' = T plus padding for sequence parallelism)
    position_ids: torch.Tensor  # [1, T']
    labels: torch.Tensor  # [T'] next-token ids, IGNORE_INDEX at sequence ends and padding
    params: Any  # PackedSeqParams
    real: int  # T
    rows: torch.Tensor  # [b] int64 rows of the whole batch (device), empty for the stand-in
    cp: CPSplit | None = None  # context parallelism: how this rank's tokens map to the micro-batch


class MCoreStep(MCoreOptim):
    """``forward_backward`` and ``infer`` over packed micro-batches."""

    def _check_batch(self, batch: TokenBatch) -> TokenBatch:
        """Validate ``batch`` and return it on the host (cpu).

        Every check reads host tensors: a batch given on the host (what data pipelines produce) is
        validated, planned and packed without any device->host synchronisation; a batch given on the
        device is copied to the host once here (one synchronisation instead of one per check and per
        micro-batch). ``InvalidInput`` before any state changes."""
        if batch.has_vision:
            raise InvalidInput(
                "TokenBatch carries images/videos but the mcore engine runs text decoders only; train "
                "vision-language models with the fsdp2 engine (UNDERLAY_ENGINE=fsdp2)"
            )
        tensors = [batch.input_ids, batch.attention_mask, batch.loss_mask, *batch.extras.values()]
        host = batch if all(t.device.type == "cpu" for t in tensors) else batch.to(torch.device("cpu"))
        check_token_batch(host, self._arch.vocab)
        return host

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (host) on the engine's device without waiting for it: the copy is queued on the current
        stream (a pageable source is staged by CUDA before the call returns, so ``t`` may be freed)."""
        return t.to(self._torch_device, non_blocking=True)

    def _batch_to_device(self, batch: TokenBatch) -> TokenBatch:
        return TokenBatch(
            self._to_device(batch.input_ids),
            self._to_device(batch.attention_mask),
            self._to_device(batch.loss_mask),
            {k: self._to_device(v) for k, v in batch.extras.items()},
        )

    def _plan(self, host: TokenBatch) -> list[list[int]]:
        """Micro-batches of ``host`` (a host batch from ``_check_batch``): lengths are read on the host;
        the count is agreed over data parallel (one all-reduce; none at dp = 1)."""
        from underlay.ops import plan_micro_batches

        seqlens = host.attention_mask.sum(dim=1).tolist()
        pp = self._layout.pp
        multiple = pp if self._layout.vpp > 1 else 1
        plan = plan_micro_batches(
            seqlens,
            self._config.micro_batch_max_tokens,
            group=self._pg["dp"] if self._layout.dp_shard > 1 else None,
            multiple_of=multiple,
        )
        check_interleaved_count(
            len(plan),
            pp=pp,
            vpp=self._layout.vpp,
            group_size=self._tf_config.microbatch_group_size_per_vp_stage,
        )
        return plan

    def _micro_batches(self, host: TokenBatch, plan: list[list[int]]) -> list[_MicroBatch]:
        """The packed micro-batches of ``plan``. With virtual pipelines every micro-batch of the step is
        padded to one token count (the longest, agreed over the model-parallel group, a multiple of
        tp under sequence parallelism) and megatron runs with fixed shapes: its per-micro-batch shape
        exchange (``variable_seq_lengths``) posts both directions' receives from the one peer at pp=2
        in a single batched call, where they pair with the peer's sends by posting order and the
        shapes swap (gloo then hangs on a size mismatch). The agreement is one small all-reduce."""
        if self._layout.vpp == 1:
            return [self._micro_batch(host, idx) for idx in plan]
        from megatron.core import parallel_state as ps

        lengths = host.attention_mask.sum(dim=1).tolist()
        cp = self._layout.cp
        if cp > 1:  # the count is per CP rank: each sequence's load-balanced share (local_token_count)
            from underlay.engines.mcore.context_parallel import local_token_count

            longest = max(local_token_count([int(lengths[i]) for i in idx] or [1], cp) for idx in plan)
        else:
            longest = max(max(sum(int(lengths[i]) for i in idx) for idx in plan), 1)
        agreed = torch.tensor([longest], dtype=torch.int64).to(self._torch_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
        length = int(agreed.item())
        if self._tf_config.sequence_parallel:
            length = -(-length // self._layout.tp) * self._layout.tp
        if cp > 1 and length % 2:  # CP shares come in pairs of equal chunks
            length += self._layout.tp if self._tf_config.sequence_parallel else 1
        return [self._micro_batch(host, idx, length) for idx in plan]

    def _micro_batch(self, host: TokenBatch, idx: list[int], length: int | None = None) -> _MicroBatch:
        """Pack the rows ``idx`` of the host batch on the host (lengths, labels, ``cu_seqlens`` and the
        longest sequence are host values), then queue the packed tensors to the device; ``length``
        pads the micro-batch to that many tokens with a masked padding sequence (virtual pipelines;
        under context parallelism ``length`` is this CP rank's token count after the split)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from underlay.engines.mcore.layers import DEVICE_CU_ATTR
        from underlay.ops import unpad
        from underlay.ops.attention import attach_seqlens

        if idx:
            sub: TokenBatch | None = host.select(idx)
            assert sub is not None
            packed = unpad(sub.input_ids, sub.attention_mask)
        else:  # a one-token stand-in: this dp rank has no sequence in this slot
            sub = None
            one = host.select([0])
            packed = unpad(one.input_ids[:, :1], torch.ones_like(one.attention_mask[:, :1]))
        ids = packed.input_ids
        pos = packed.position_ids
        cu = packed.cu_seqlens.to(torch.int32)
        real = int(ids.numel())
        tp = self._layout.tp
        if self._layout.cp > 1:  # the CP split pads (``length`` is then the per-rank count)
            pad = 0
        elif length is not None:  # a fixed token count (virtual pipelines): a masked padding sequence
            pad = length - real
        else:
            pad = (-real) % tp if self._tf_config.sequence_parallel else 0
        labels = torch.full((real + pad,), IGNORE_INDEX, dtype=torch.long)
        labels[: real - 1] = ids[1:]
        ends = (cu[1:] - 1).long()
        labels[ends] = IGNORE_INDEX
        lens = packed.seqlens
        if self._layout.cp > 1:
            dev = self._to_device
            return self._cp_micro_batch(
                None if sub is None else self._batch_to_device(sub),
                self._packed_to_device(packed),
                dev(ids),
                dev(pos),
                dev(labels[:real]),
                dev(cu),
                real,
                dev(torch.as_tensor(idx, dtype=torch.long)),
                length,
            )
        if pad:
            ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
            pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
            cu = torch.cat([cu, torch.tensor([real + pad], dtype=torch.int32)])
            lens = [*lens, pad]
        max_len = max(lens)
        dev = self._to_device
        # the attention kernel's length checks take these host lengths instead of reading cu_seqlens
        cu_dev = attach_seqlens(dev(cu), lens)
        cu_given = cu_dev
        if self._host_cu_seqlens:
            # megatron's unfused THD RoPE reads cu_seqlens on the host in every layer: give it the
            # host tensor, and underlay's CoreAttention the device copy (TE's spec takes device ones)
            cu_given = cu.clone()
            setattr(cu_given, DEVICE_CU_ATTR, cu_dev)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_given,
            cu_seqlens_kv=cu_given,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        return _MicroBatch(
            None if sub is None else self._batch_to_device(sub),
            self._packed_to_device(packed),
            dev(ids)[None],
            dev(pos)[None],
            dev(labels),
            params,
            real,
            dev(torch.as_tensor(idx, dtype=torch.long)),
        )

    def _packed_to_device(self, packed: Any) -> Any:
        """The host ``PackedBatch`` with its tensors queued to the device (``ops.pad`` scatters there)."""
        dev = self._to_device
        return dataclasses.replace(
            packed,
            input_ids=dev(packed.input_ids),
            cu_seqlens=dev(packed.cu_seqlens),
            indices=dev(packed.indices),
            position_ids=dev(packed.position_ids),
        )

    def _cp_micro_batch(
        self,
        sub: TokenBatch | None,
        packed: Any,
        ids: torch.Tensor,
        pos: torch.Tensor,
        labels: torch.Tensor,
        cu: torch.Tensor,
        real: int,
        rows: torch.Tensor,
        local_length: int | None = None,
    ) -> _MicroBatch:
        """This CP rank's share of a packed micro-batch (``context_parallel.split_packed``): the
        load-balanced chunks of every sequence, global real and padded ``cu_seqlens`` for megatron's
        RoPE and the attention core; the local count a multiple of tp under sequence parallelism."""
        from megatron.core import parallel_state as ps
        from megatron.core.packed_seq_params import PackedSeqParams

        from underlay.engines.mcore.context_parallel import split_packed

        multiple = self._layout.tp if self._tf_config.sequence_parallel else 1
        group = ps.get_context_parallel_group()
        ids, pos, labels, split = split_packed(
            ids, pos, labels, cu, group=group, multiple=multiple, local_length=local_length
        )
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=split.cu_real,
            cu_seqlens_kv=split.cu_real,
            cu_seqlens_q_padded=split.cu_padded,
            cu_seqlens_kv_padded=split.cu_padded,
            max_seqlen_q=split.max_seqlen,
            max_seqlen_kv=split.max_seqlen,
        )
        return _MicroBatch(sub, packed, ids[None], pos[None], labels, params, real, rows, split)

    def _head_outputs(
        self, model: Any, output: torch.Tensor, mb: _MicroBatch, temperature: float, with_entropy: bool
    ) -> TokenOutputs:
        """Token-aligned ``[b, S]`` outputs of one micro-batch from the last stage's output ``[1, T',
        H]`` (the final hidden states): log-probs (and entropy) through the vocab-parallel log-prob
        kernel. For a value model ``output`` is the value head's ``[1, T', 1]`` and the result holds
        ``values`` only: ``values[t]`` scores token ``t`` itself (no shift, as Hugging Face's token
        classification), fp32, 0 at padding. Under context parallelism ``T'`` are this CP rank's
        tokens (``mb.cp``'s split); the outputs are gathered over CP (collective over the CP group)
        and cover the whole micro-batch on every CP rank; the backward keeps this rank's tokens'
        share."""
        from underlay.ops import pad

        real = mb.real
        if self._value:
            flat = output.reshape(-1)
            # under context parallelism ``output`` holds this CP rank's load-balanced chunks: gather
            # them over CP into the packed order, as the log-probs below (padding is dropped there)
            values = (mb.cp.gather(flat) if mb.cp is not None else flat[:real]).to(torch.float32)
            return TokenOutputs(None, None, pad(values, mb.packed) if mb.sub is not None else values)
        inner = _unwrap(model)
        weight = (
            inner.shared_embedding_or_output_weight()
            if inner.share_embeddings_and_output_weights
            else inner.output_layer.weight
        )
        h = output.reshape(-1, output.shape[-1])
        group = self._pg["tp"] if self._layout.tp > 1 else None
        if self._arch.vocab_rows != self._arch.vocab:  # padded rows get no probability
            from megatron.core import parallel_state as ps

            from underlay.engines.mcore.vocab import mask_padded_rows

            rank = ps.get_tensor_model_parallel_rank()
            h, weight = mask_padded_rows(h, weight, vocab=self._arch.vocab, rank=rank)
        out = self._logprob_kernel(
            h, weight, mb.labels, temperature=temperature, with_entropy=with_entropy, vocab_group=group
        )
        split = mb.cp

        def align(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            if split is not None:  # every CP rank gets the whole micro-batch, in packed order
                x = split.gather(x)
            shifted = torch.cat([x.new_zeros(1), x[: real - 1]])
            return pad(shifted.to(torch.float32), mb.packed) if mb.sub is not None else shifted

        return TokenOutputs(align(out.log_probs), align(out.entropy), None)

    def _stage(self) -> str:
        """``"pipeline stage P of PP"`` for this rank: where a shared failure says it happened."""
        from megatron.core import parallel_state as ps

        return f"pipeline stage {ps.get_pipeline_model_parallel_rank()} of {self._layout.pp}"

    def _stand_in(self, model: Any, mb: _MicroBatch) -> torch.Tensor:
        """A zero output of the chunk ``model`` for ``mb`` in the place of a forward that raised, shaped
        as megatron's ``GPTModel`` stage output so the schedule's transfers stay paired: ``[b=1, T',
        hidden]`` (``[1, T', 1]`` for a value model) on the last stage, whose output layer returns the
        hidden states gathered over sequence parallelism (``T'`` = ``mb``'s tokens on this CP rank,
        transposed by ``GPTModel``'s post-process); the received input's shape and dtype ``[s_local, 1,
        hidden]`` on a stage that receives one (megatron's ``set_input_tensor`` puts it in
        ``decoder.input_tensor``); ``[T' / tp under sequence parallelism, 1, hidden]`` in
        ``pipeline_dtype`` on the first stage. Not a view (megatron's ``deallocate_output_tensor``
        refuses views). It depends on the received input (the backward then gives the previous stage
        a zero ``input_tensor.grad`` to send upstream instead of ``None``) and on every trainable
        parameter of the chunk through a zero factor: backward has a graph on every stage, and with
        ``overlap_grad_reduce`` every gradient bucket becomes ready on this rank as on its
        data-parallel peers, whose bucket reductions would otherwise wait for this rank."""
        inner = _unwrap(model)
        cfg = self._tf_config
        received = getattr(getattr(inner, "decoder", None), "input_tensor", None)
        tokens = int(mb.input_ids.shape[1])
        if inner.post_process:
            shape: tuple[int, ...] = (1, tokens, 1 if self._value else cfg.hidden_size)
            dtype = cfg.params_dtype
        elif received is not None:
            shape, dtype = tuple(received.shape), received.dtype
        else:
            local = tokens // self._layout.tp if cfg.sequence_parallel else tokens
            shape, dtype = (local, 1, cfg.hidden_size), cfg.pipeline_dtype
        out = torch.zeros(shape, dtype=dtype, device=self._torch_device)
        links = [p.reshape(-1)[:1].sum().float() for p in model.parameters() if p.requires_grad]
        if received is not None and received.requires_grad:
            links.append(received.sum().float())
        if links:
            out = out + (torch.stack(links).sum() * 0.0).to(dtype)
        return out

    def _run_schedule(
        self,
        mbs: list[_MicroBatch],
        loss_func: Any,
        forward_only: bool,
        failed: list[Exception] | None = None,
    ) -> None:
        """Run megatron's schedule over ``mbs``. With ``failed`` given, an ``Exception`` raised by the
        model forward of a micro-batch is appended to ``failed`` (the caller raises the first after
        the schedule) and the forward returns ``_stand_in`` instead, so the other stages' transfers
        are answered; ``loss_func`` sees ``failed`` non-empty and takes its failed path."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb = next(data_iterator)
            try:
                # after a failure the later micro-batches still run the model, as after a loss_fn
                # failure: a TP peer whose forward did not raise (a failure past the forward's last
                # TP collective, or none on that rank) runs its next forwards, whose TP collectives
                # this rank must answer; a deterministic failure raises again and is substituted again
                out = model(
                    input_ids=mb.input_ids,
                    position_ids=mb.position_ids,
                    attention_mask=None,
                    packed_seq_params=mb.params,
                )
            except Exception as exc:
                if failed is None:
                    raise
                failed.append(exc)
                out = self._stand_in(model, mb)
            return out, partial(loss_func, model, mb)

        fb = get_forward_backward_func()
        iters: Any = [iter(mbs) for _ in self._chunks]
        fb(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self._chunks if len(self._chunks) > 1 else self._chunks[0],
            num_microbatches=len(mbs),
            # megatron divides this by cp (the local length); only a hint with variable_seq_lengths
            seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs) * self._layout.cp,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn) -> StepResult:
        """Accumulate gradients of the sum of ``loss_fn``'s contributions over ``batch`` (this dp
        rank's share; loss contract v3, ``interfaces.LossFn``).

        Micro-batches come from ``ops.plan_micro_batches`` (same count on every dp rank, a multiple of
        pp with virtual pipelines); megatron's schedule runs them; on the last stage each micro-batch's
        per-token outputs (``TokenOutputs``: log-probs and entropy, or ``values`` for a value model)
        go to ``loss_fn`` with its ``LossContext`` (``engines._loss``; every CP rank gets the whole
        micro-batch and the same context). Gradients sum over micro-batches and dp x cp: megatron's
        per-token-loss mode sums in its DDP; the reduction (``finalize_grads``) runs once per optimizer
        step, so several calls accumulate like one call over their concatenated micro-batches. Metrics reduce as declared over dp on the last
        stage and are broadcast over the pipeline so every rank returns the same ``StepResult``.
        ``InvalidInput`` on a malformed batch or ``loss_fn`` before any compute. When the ``loss_fn``
        raises an ``Exception`` (or returns what ``checked_loss`` refuses: ``InvalidInput``) on a
        micro-batch of any rank, that rank holds the exception, skips the ``loss_fn`` for its remaining
        micro-batches (a zero loss through the head keeps the schedule's transfers and the TP
        collectives paired, so no rank waits: with pp > 1 only the last stage runs the ``loss_fn``),
        and after the schedule every rank learns of it (``parallel.agree.shared_failure``), drops every
        accumulated gradient (this call's and the earlier calls' since the last step) and raises: the
        failing rank its own exception, every other rank the first failing rank's (same type and
        message, a note naming that rank and its pipeline stage; ``UnderlayError`` with its text when
        it does not pickle). The next step equals a fresh engine's (``docs/reliability.md`` §6).
        An ``Exception`` raised by the model forward of a micro-batch on any pipeline stage is held
        the same way (the first failure of the rank, model or ``loss_fn``, is the one raised): the
        forward returns a zero stand-in of the stage's output shape (``_stand_in``) so the next
        stage receives its tensor and the backward sends a zero gradient upstream; the last stage's
        ``loss_fn`` is skipped from then on; the later micro-batches run the model again.
        Not covered (the rank leaves at once with its gradients dropped, or its peers wait until the
        collective timeout): a ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``), never
        caught; a model failure on some ranks only of a TP, CP or EP group whose peers then wait in
        a collective of the same forward (the tensor-parallel all-reduces, the context-parallel
        attention exchange, the expert all-to-all): covered only when every rank of those groups
        raises at the same point (a failure determined by the micro-batch, as a bad input); a failure
        inside megatron's pipeline transfers or its schedule itself (outside the model forward and
        the ``loss_fn``).

        Host synchronisation: validation, planning and packing read host tensors (none for a host
        batch; one copy for a device batch); the global counts are one all-reduce before the first
        micro-batch, the failure flag one small all-reduce (world > 1) after the schedule, the
        metrics one at the end, each read once."""
        from megatron.core import parallel_state as ps

        check_loss_fn(loss_fn)
        self._ensure_adapters_on()
        host = self._check_batch(batch)
        self._ensure_onloaded("forward_backward")
        if self._grads == "reduced":
            raise InvalidInput(
                "forward_backward: the accumulated gradients were already reduced over the ranks "
                "(finalize_grads); call optimizer_step or zero_grad before the next forward_backward"
            )
        if self._grads == "local" and self._opts.overlap_grad_reduce:
            raise InvalidInput(
                "forward_backward: with MCoreOptions.overlap_grad_reduce=True each forward_backward starts "
                "the gradient reduction during its last micro-batch, so it must be the only one before "
                "optimizer_step or zero_grad; pass all micro-batches in one call or set "
                "overlap_grad_reduce=False to accumulate over several calls"
            )
        dp_group = self._pg["dp"] if self._layout.dp > 1 else None
        counts = count_loss(host.loss_mask, dp_group, self._layout.dp, self._torch_device)
        plan = self._plan(host)
        mbs = self._micro_batches(host, plan)
        contexts = {
            id(mb): counts.context(i, len(plan), idx, None if mb.sub is None else mb.sub.loss_mask)
            for i, (mb, idx) in enumerate(zip(mbs, plan))
        }
        reducer = MetricReducer(self._torch_device)
        temperature = self._config.temperature
        with_entropy = self._config.with_entropy

        failed: list[Exception] = []  # this rank's failures (model forward or loss_fn); the first wins

        def loss_func(model: Any, mb: _MicroBatch, output: torch.Tensor) -> Any:
            no_tokens = torch.zeros((), dtype=torch.int, device=output.device)
            if mb.sub is None:
                return output.sum() * 0.0, no_tokens, {}
            try:  # the head's collectives (TP, CP) run on every micro-batch, also after a failure
                outputs = self._head_outputs(model, output, mb, temperature, with_entropy)
            except Exception as exc:
                failed.append(exc)
                return output.sum() * 0.0, no_tokens, {}
            if not failed:
                try:
                    loss, metrics = checked_loss(loss_fn(outputs, mb.sub, contexts[id(mb)]))
                except Exception as exc:
                    failed.append(exc)
                else:
                    reducer.add(loss, metrics)
                    return loss, no_tokens, {}
            # after a failure the schedule still runs to its end (the other stages wait in its
            # transfers) with a zero loss through the head, whose backward the TP peers share
            got = outputs.values if self._value else outputs.log_probs
            assert got is not None
            return got.sum() * 0.0, no_tokens, {}

        for c in self._chunks:
            c.train()
        self._grads = "local"
        try:
            self._run_schedule(mbs, loss_func, forward_only=False, failed=failed)
        except BaseException:
            self._drop_grads()
            raise
        failure = shared_failure(
            failed[0] if failed else None,
            what="forward_backward",
            where=self._stage(),
        )
        if failure is not None:
            # a failed micro-batch (the loss_fn raised or returned a bad value) must not leak its
            # partial gradients, nor the earlier calls', into the next step: dropped on every rank
            self._drop_grads()
            raise failure
        metrics = self._share_metrics(reducer, dp_group, ps.is_pipeline_last_stage(ignore_virtual=True))
        if report_nonfinite("forward_backward", metrics, reducer.local(), self._torch_device):
            self._skip_next = True
        return StepResult(metrics, len(plan), counts.global_tokens, counts.global_sequences)

    def _share_metrics(self, reducer: MetricReducer, dp_group: Any, last: bool) -> dict[str, float]:
        """Reduce the metrics over dp on the last stage and broadcast them from there over pp."""
        from megatron.core import parallel_state as ps

        box: list[Any] = [reducer.reduce(dp_group, self._layout.dp) if last else None]
        if self._layout.pp > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(box, src=src, group=self._pg["pp"])
        return dict(box[0])

    @torch.no_grad()
    def infer(
        self, batch: TokenBatch, *, temperature: float | None = None, with_entropy: bool = False
    ) -> TokenOutputs:
        """Per-token log-probs (and entropy when ``with_entropy``), or ``values`` for a value model,
        ``[B, S]`` fp32 on the device, rows in the order of ``batch``, 0 at padding (log-probs and
        entropy also at position 0), on every rank (broadcast from the last pipeline stage).

        At pp > 1 an ``Exception`` raised by the model forward of a micro-batch on any stage is held
        as in ``forward_backward`` (a zero stand-in keeps the schedule's transfers paired) and, after
        the schedule, raised on every rank (``parallel.agree.shared_failure``: one small all-reduce
        and one host read per call at pp > 1); at pp = 1 it leaves at once (no stage waits for this
        one). Not covered, as there: ``BaseException``, a failure on some ranks only of a TP, CP or EP
        group inside a collective of the same forward, a failure in megatron's transfers."""
        from megatron.core import parallel_state as ps

        host = self._check_batch(batch)
        self._ensure_onloaded("infer")
        temp = self._config.temperature if temperature is None else temperature
        if not temp > 0:
            raise InvalidInput(f"infer: temperature={temp} must be > 0")
        with_entropy = with_entropy and not self._value
        plan = self._plan(host)
        mbs = self._micro_batches(host, plan)
        shape = tuple(host.input_ids.shape)
        main = torch.zeros(shape, dtype=torch.float32, device=self._torch_device)
        ent = torch.zeros(shape, dtype=torch.float32, device=self._torch_device) if with_entropy else None

        def loss_func(model: Any, mb: _MicroBatch, output: torch.Tensor) -> Any:
            zero = torch.zeros((), device=output.device)
            if mb.sub is not None:
                out = self._head_outputs(model, output, mb, temp, with_entropy)
                got = out.values if self._value else out.log_probs
                assert got is not None
                main[mb.rows] = got
                if ent is not None and out.entropy is not None:
                    ent[mb.rows] = out.entropy
            return zero, torch.zeros((), dtype=torch.int, device=output.device), {}

        for c in self._chunks:
            c.eval()
        failed: list[Exception] | None = [] if self._layout.pp > 1 else None
        self._run_schedule(mbs, loss_func, forward_only=True, failed=failed)
        if failed is not None:
            failure = shared_failure(
                failed[0] if failed else None,
                what="infer",
                where=self._stage(),
            )
            if failure is not None:
                raise failure
        if self._layout.pp > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(main, src=src, group=self._pg["pp"])
            if ent is not None:
                dist.broadcast(ent, src=src, group=self._pg["pp"])
        if self._value:
            return TokenOutputs(None, None, main)
        return TokenOutputs(main, ent, None)
