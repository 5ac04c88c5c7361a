"""The per-process body of ``underlay demo``: a miniature GRPO loop over the whole library.

Every rank holds a shard of the policy in the parallel engine and starts a rollout worker process
(``underlay.rollout.HFRolloutWorker``: a plain Hugging Face copy of the same model) as its "rollout
engine", fed through a colocated ``WeightSender`` (shared memory on cpu, CUDA IPC on cuda). One step:

1. ``sync``: stream the engine's full HF-named weights (``engine.iter_weights``) into the worker;
2. ``gen``: sample ``responses_per_prompt`` responses for this rank's share of the prompts;
3. score them with the echo task's rule-based reward and turn scores into GRPO advantages with
   ``ops.group_normalize`` over the responses of each prompt;
4. ``old_logprob``: ``engine.infer`` (no grad) for the PPO ratio's denominator;
5. ``update``: ``engine.forward_backward`` with a clipped policy-gradient loss (packed, balanced
   micro-batches and the LogprobKernel inside the engine), ``optimizer_step``, ``lr_scheduler_step``.

The prompts come through the data pipeline a real trainer uses: rank 0 writes the task's dataset file
(``out_dir/data/echo_train.jsonl``), every rank trains the same BPE tokenizer with a chat template on it
(``tokenizers``, deterministic), reads it with ``read_records`` into an ``RLPromptDataset`` (chat
template, system prompt, ground truth carried for the reward) and draws its share of every step's
prompts from a ``ResumableSampler`` whose state is saved in the checkpoint's trainer state.

Around the loop: a torch-profiler trace of one step, a checkpoint before the last step that is reloaded
afterwards to redo that step with identical numbers, an HF export reloaded with ``transformers`` whose
logits equal the rollout copy's, and per-step metrics through ``underlay.tracking``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from underlay.data import echo
from underlay.data.collate import PromptBatch, collate_prompts
from underlay.data.datasets import RLPromptDataset, read_records
from underlay.data.sampler import ResumableSampler
from underlay.demo.config import DemoConfig, tiny_hf_config
from underlay.demo.tokenizer import train_chat_tokenizer
from underlay.interfaces import (
    CheckpointError,
    Device,
    EngineConfig,
    LossContext,
    ModelConfig,
    OptimConfig,
    ParallelEngine,
    Profiler,
    ProfilerConfig,
    TokenBatch,
    TokenOutputs,
)
from underlay.ops import aggregate_loss
from underlay.parallel.rank import current_rank, current_world_size
from underlay.utils import env as _env

__all__ = ["CONSOLE_KEYS", "RESUME_RTOL_ACCELERATOR", "PolicyLoss", "learning_summary", "run_rank"]

RESUME_RTOL_ACCELERATOR = 1e-3
"""Largest relative loss/grad-norm difference of the redone step accepted on an accelerator."""

CONSOLE_KEYS = (
    "loss",
    "reward/mean",
    "accuracy",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "timing/gen",
    "timing/old_logprob",
    "timing/update",
    "timing/sync",
)
"""What the console prints per step (the jsonl and TensorBoard get every metric)."""


class PolicyLoss:
    """PPO-clip policy-gradient loss for ``ParallelEngine.forward_backward``.

    Needs ``batch.extras["advantages"]`` ``[b]`` and ``batch.extras["old_log_probs"]`` ``[b, S]``.
    Per token ``t`` of ``batch.loss_mask``: ``ratio = exp(logp - old_logp)``,
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``. Returns the micro-batch's
    contribution to the token mean over the global batch (``ops.aggregate_loss`` "token-mean", loss
    contract v3) and metrics that are contributions of the same kind (token means over the global
    batch once summed): ``pg_loss``, ``clip_frac``, ``approx_kl`` (``old_logp - logp``) and
    ``entropy`` when available.
    """

    def __init__(self, clip_eps: float) -> None:
        self.clip_eps = clip_eps

    def __call__(
        self, outputs: TokenOutputs, batch: TokenBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """Loss and metric contributions of one micro-batch (see the class docstring)."""
        assert outputs.log_probs is not None, "the demo trains a causal LM"
        logp = outputs.log_probs
        mask = batch.loss_mask.to(logp.dtype)
        old = batch.extras["old_log_probs"].to(logp.dtype)
        adv = batch.extras["advantages"].to(logp.dtype)[:, None]
        ratio = torch.exp(logp - old)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_eps, 1.0 + self.clip_eps)
        per_token = torch.maximum(unclipped, clipped)
        loss = aggregate_loss(per_token, batch.loss_mask, "token-mean", ctx)
        n = max(ctx.global_loss_tokens, 1)
        metrics: dict[str, torch.Tensor | float] = {
            "pg_loss": loss.detach(),
            "clip_frac": ((clipped > unclipped).to(logp.dtype) * mask).sum().detach() / n,
            "approx_kl": ((old - logp).detach() * mask).sum() / n,
        }
        if outputs.entropy is not None:
            metrics["entropy"] = (outputs.entropy.detach() * mask).sum() / n
        return loss, metrics


@dataclass
class _Rollout:
    """Prompt/response batch of this rank for one step."""

    batch: TokenBatch
    rewards: torch.Tensor
    correct: torch.Tensor
    response_lengths: torch.Tensor


class _LineStream:
    """A text stream that writes whole lines through ``tqdm.write`` so the progress bar stays intact."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._bar.write(line)
        return len(text)

    def flush(self) -> None:
        """Nothing buffered beyond an incomplete line."""


class _Progress:
    """tqdm when installed (else a plain ``[k/n]`` line per step), or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._done = 0
        self._total = total
        self._enabled = enabled
        self.stream: TextIO | None = None
        if not enabled:
            return
        try:
            import importlib

            tqdm: Any = importlib.import_module("tqdm").tqdm
            self._bar = tqdm(total=total, desc="underlay demo", unit="step", leave=True, file=sys.stderr)
            self.stream = _LineStream(self._bar)  # type: ignore[assignment]
        except ImportError:
            self._bar = None

    def update(self, label: str) -> None:
        """One step done."""
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        elif self._enabled:
            print(f"[{self._done}/{self._total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()


class _Trainer:
    """State of one rank: engine, rollout copy, tokenizer, profiler."""

    def __init__(self, cfg: DemoConfig, device: Device, rank: int, world: int, out: Path) -> None:
        import underlay

        self.cfg, self.device, self.rank, self.world, self.out = cfg, device, rank, world, out
        self.data_path = _write_task_data(cfg, out, rank)
        rows = read_records(self.data_path)
        corpus = [echo.SYSTEM_PROMPT, *echo.WORDS, *(m["content"] for r in rows for m in r["prompt"])]
        self.tok = train_chat_tokenizer(corpus)
        self.dataset = RLPromptDataset(
            rows,
            self.tok,
            field_keys=["ground_truth"],
            system_prompt=echo.SYSTEM_PROMPT,
            max_length=32,
            overlong="error",
        )
        self.sampler = ResumableSampler(
            len(self.dataset),
            cfg.prompts_per_step,
            seed=cfg.seed,
            rank=rank,
            world_size=world,
            fingerprint=self.dataset.fingerprint,
        )
        self.last_indices: list[int] = []
        self.hf_config = tiny_hf_config(
            cfg.model_size, len(self.tok), self.tok.pad_token_id, self.tok.bos_token_id, self.tok.eos_token_id
        )
        accel = device.is_accelerator
        if accel:  # reproducible resume: no nondeterministic scatter/atomic kernels where avoidable
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.param_dtype = "bfloat16" if accel else "float32"
        self.dtype = torch.bfloat16 if accel else torch.float32
        self.engine: ParallelEngine = underlay.get_engine(
            EngineConfig(
                model=ModelConfig(hf_config=self.hf_config, seed=cfg.seed),
                optim=OptimConfig(lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, grad_clip=1.0),
                micro_batch_max_tokens=cfg.micro_batch_max_tokens,
                param_dtype=self.param_dtype,
                temperature=cfg.temperature,
                with_entropy=True,
            )
        )
        from underlay.rollout import HFRolloutWorker, WeightSender

        self.torch_device = self.engine.device.torch_device()
        # the rollout engine lives in a process of its own, kept in step by the weight-sync receiver
        self.sender = WeightSender.colocated(device, bucket_bytes=1 << 22, wait=False)
        self.rollout = HFRolloutWorker(
            tiny_hf_config(
                cfg.model_size,
                len(self.tok),
                self.tok.pad_token_id,
                self.tok.bos_token_id,
                self.tok.eos_token_id,
            ),
            dtype=self.dtype,
            device=device.name,
            device_index=device.current_index() if accel else None,
            port=self.sender.port,
        )
        self.rollout.wait_ready()
        self.sender.wait_for_receivers()
        self.loss_fn = PolicyLoss(cfg.clip_eps)
        from underlay.ops import FlopsCounter

        self.flops = FlopsCounter(self.hf_config)
        self.per_rank = cfg.prompts_per_step // world
        self.last_batch: TokenBatch | None = None

    # ------------------------------------------------------------------------------------ pieces

    @contextlib.contextmanager
    def phase(self, name: str, prof: Profiler, into: MutableMapping[str, float]) -> Iterator[None]:
        """Time ``name`` into ``into["timing/<name>"]`` and mark it as a profiler range."""
        from underlay.profiling import timer

        with prof.range(name), timer(f"timing/{name}", into=into, device=self.device):
            yield

    def sync_rollout(self) -> int:
        """Send the engine's full weights to the rollout worker; returns the bytes moved. Raises
        ``RolloutWorkerError`` when the worker refused the sync (its weights then stay as they were)."""
        self.rollout.start_receive()
        report = self.sender.sync(self.engine)
        self.rollout.finish_receive()
        return report.nbytes

    def close(self) -> None:
        """Stop the rollout worker and release the sync buffer."""
        self.rollout.close()
        self.sender.close()

    def prompts(self) -> PromptBatch:
        """This rank's share of the next step's prompts, drawn from the sampler (advances it)."""
        self.last_indices = self.sampler.next_batch()
        return collate_prompts([self.dataset[i] for i in self.last_indices], self.tok.pad_token_id)

    def generate(self, step: int) -> _Rollout:
        """Sample, score and pack this rank's responses for ``step`` (deterministic given the weights
        and the sampler state)."""
        cfg, tok = self.cfg, self.tok
        pb = self.prompts()
        n = cfg.responses_per_prompt
        answers = [f["ground_truth"] for f in pb.fields for _ in range(n)]
        ids = pb.batch.input_ids.repeat_interleave(n, dim=0)
        am = pb.batch.attention_mask.repeat_interleave(n, dim=0)
        out = self.rollout.generate(
            ids,
            am,
            seed=cfg.seed * 100_003 + step * self.world + self.rank,
            do_sample=True,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        from underlay.ops import response_mask

        resp = out[:, ids.shape[1] :].cpu()
        rlen = response_mask(resp, tok.eos_token_id).sum(dim=1)
        plen = am.sum(dim=1).cpu()
        texts = [tok.decode(resp[i, : int(rlen[i])], skip_special_tokens=True) for i in range(len(answers))]
        rewards = torch.tensor([echo.reward(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
        # right-padded rows: prompt tokens, then response tokens (up to and including the first eos)
        seq = int((plen + rlen).max())
        input_ids = torch.full((len(answers), seq), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros(len(answers), seq, dtype=torch.long)
        loss_mask = torch.zeros(len(answers), seq, dtype=torch.long)
        ids_cpu, am_cpu = ids.cpu(), am.cpu().bool()
        for i in range(len(answers)):
            p, r = int(plen[i]), int(rlen[i])
            input_ids[i, :p] = ids_cpu[i][am_cpu[i]]
            input_ids[i, p : p + r] = resp[i, :r]
            attn[i, : p + r] = 1
            loss_mask[i, p : p + r] = 1
        batch = TokenBatch(input_ids, attn, loss_mask)
        return _Rollout(batch, rewards, (rewards == 1.0).to(torch.float32), rlen.to(torch.float32))

    def step(self, step: int, prof: Profiler) -> dict[str, float]:
        """One GRPO step; returns the global metrics (identical on every rank)."""
        from underlay.ops import group_normalize
        from underlay.profiling import reduce_timings

        timings: dict[str, float] = {}
        with self.phase("sync", prof, timings):
            sync_bytes = self.sync_rollout()
        with self.phase("gen", prof, timings):
            ro = self.generate(step)
        self.last_batch = ro.batch
        group_ids = torch.arange(self.per_rank).repeat_interleave(self.cfg.responses_per_prompt)
        group_ids = group_ids + self.rank * self.per_rank
        adv = group_normalize(ro.rewards, group_ids)
        batch = TokenBatch(
            ro.batch.input_ids, ro.batch.attention_mask, ro.batch.loss_mask, {"advantages": adv}
        ).to(self.torch_device)
        with self.phase("old_logprob", prof, timings):
            old = self.engine.infer(batch).log_probs
        assert old is not None
        batch = TokenBatch(
            batch.input_ids,
            batch.attention_mask,
            batch.loss_mask,
            {"advantages": batch.extras["advantages"], "old_log_probs": old.detach()},
        )
        with self.phase("update", prof, timings):
            res = self.engine.forward_backward(batch, self.loss_fn)
            opt = self.engine.optimizer_step()
            lr = self.engine.lr_scheduler_step()
        seqlens = ro.batch.attention_mask.sum(dim=1).tolist()
        mfu = self.flops.mfu(seqlens, timings["timing/update"], self.device, self.dtype)
        local = torch.tensor(
            [
                float(ro.rewards.sum()),
                float(ro.correct.sum()),
                float(ro.response_lengths.sum()),
                float(ro.rewards.numel()),
                float(sum(seqlens)),
                float("nan") if mfu is None else float(mfu),
            ],
            dtype=torch.float64,
        )
        if dist.is_initialized():
            from underlay.ops import collective_device

            local = local.to(collective_device())  # cpu for gloo, the accelerator for nccl/hccl
            dist.all_reduce(local)
        r_sum, c_sum, len_sum, count, tokens, mfu_sum = local.cpu().tolist()
        t = reduce_timings(timings)
        metrics: dict[str, float] = {
            "loss": float(res.metrics["pg_loss"]),
            "reward/mean": r_sum / count,
            "accuracy": c_sum / count,
            "grad_norm": float(opt.grad_norm),
            "lr": float(lr),
            "step_skipped": float(opt.skipped),
            "response_length/mean": len_sum / count,
            "tokens": tokens,
            "tokens_per_s": tokens / max(t["timing/update/max"], 1e-9),
            "mfu": mfu_sum / self.world,
            "micro_batches": float(res.num_micro_batches),
            "sync_mib": sync_bytes / 2**20,
        }
        for k in ("clip_frac", "approx_kl", "entropy"):
            if k in res.metrics:
                metrics[k] = float(res.metrics[k])
        for name in timings:
            metrics[name] = t[f"{name}/max"]
        return metrics

    # --------------------------------------------------------------------------- export check

    def export_and_compare(self, probe: TokenBatch) -> dict[str, Any]:
        """Export HF weights + tokenizer, reload them with ``transformers`` on rank 0, and compare its
        logits with the rollout copy (synced from the engine) and its log-probs with ``engine.infer``.
        Collective."""
        import underlay

        export_dir = self.out / "hf_export"
        path = underlay.get_weight_loader().export_hf(self.engine, export_dir, dtype=self.dtype)
        self.sync_rollout()
        probe = probe.to(self.torch_device)
        engine_lp = self.engine.infer(probe).log_probs
        assert engine_lp is not None
        result: dict[str, Any] = {}
        if self.rank == 0:
            assert path is not None
            self.tok.save_pretrained(str(path))
            import transformers

            auto: Any = transformers.AutoModelForCausalLM
            reloaded: Any = auto.from_pretrained(str(path), dtype=self.dtype, local_files_only=True)
            reloaded = reloaded.to(self.torch_device).eval()
            tok2: Any = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            with torch.no_grad():
                a = self.rollout.logits(probe.input_ids, probe.attention_mask).to(self.torch_device)
                b = reloaded(input_ids=probe.input_ids, attention_mask=probe.attention_mask).logits
            mask = probe.attention_mask.bool()
            logit_diff = float((a.float() - b.float()).abs()[mask].max())
            lp = torch.log_softmax(b.float()[:, :-1], dim=-1)
            lp = lp.gather(-1, probe.input_ids[:, 1:, None]).squeeze(-1)
            lmask = probe.loss_mask[:, 1:].bool()
            lp_diff = float((lp - engine_lp[:, 1:].float()).abs()[lmask].max())
            text = "say cat"
            result = {
                "path": str(path),
                "max_abs_logit_diff": logit_diff,
                "max_abs_logprob_diff_vs_engine": lp_diff,
                "tokenizer_roundtrip": tok2.decode(tok2(text)["input_ids"], skip_special_tokens=True) == text,
            }
        return result


def _write_task_data(cfg: DemoConfig, out: Path, rank: int) -> Path:
    """Rank 0 writes the echo task's dataset (``cfg.dataset_rows`` rows, ``cfg.seed``) to
    ``out/data/echo_train.jsonl`` (atomically); every rank returns its path after a barrier."""
    path = out / "data" / "echo_train.jsonl"
    if rank == 0:
        tmp = echo.write_dataset(path.with_name("echo_train.tmp.jsonl"), cfg.dataset_rows, cfg.seed)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


def _profiler(cfg: DemoConfig, out: Path) -> Profiler:
    import underlay

    pcfg = ProfilerConfig(
        ranks=(0,), steps=(cfg.trace_step,), output_dir=str(out / "profile"), warmup=min(1, cfg.trace_step)
    )
    # an explicit name that differs from UNDERLAY_PROFILER would be an error: respect the environment
    return underlay.get_profiler(pcfg, name=None if _env.get_optional("UNDERLAY_PROFILER") else "torch")


def run_rank(cfg: DemoConfig, out_dir: str) -> dict[str, Any]:
    """Run the demo on this process (the process group is already initialised or the world is 1).
    Returns the summary on rank 0 (also written to ``out_dir/summary.json``) and ``{}`` elsewhere.

    Raises ``CheckpointError`` when the redone step after the checkpoint reload differs from the first
    run of it, or when the reloaded HF export's logits differ from the rollout copy's.
    """
    import underlay
    from underlay.checkpoint import CheckpointManager
    from underlay.tracking import Tracking

    t_start = time.perf_counter()
    out = Path(out_dir)
    device = underlay.get_device()
    rank, world = current_rank(), current_world_size()
    cfg.check_world(world)
    tr = _Trainer(cfg, device, rank, world, out)
    progress = _Progress(cfg.steps + 1, cfg.progress and rank == 0)
    backends: list[str] = ["console", "jsonl"]
    notes: list[str] = []
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        backends.append("tensorboard")
    else:
        notes.append("tensorboard not installed: no TensorBoard events (pip install 'underlay[tracking]')")
    tracker = Tracking(
        backends,
        out,
        "demo",
        config=cfg.to_dict(),
        rank=rank,
        console_keys=CONSOLE_KEYS,
        stream=progress.stream,
    )
    ckpt = CheckpointManager(out / "checkpoints", tr.engine, max_to_keep=2)
    prof = _profiler(cfg, out)
    resume_step = cfg.steps - 1
    history: list[dict[str, float]] = []
    ckpt_path: Path | None = None
    prof.start()
    for step in range(cfg.steps):
        if step == resume_step:
            trainer_state = {"next_step": step, "seed": cfg.seed, "sampler": tr.sampler.state_dict()}
            ckpt_path = Path(ckpt.save(step, trainer_state))
        t0 = time.perf_counter()
        metrics = tr.step(step, prof)
        metrics["timing/step"] = time.perf_counter() - t0
        prof.step()
        history.append(tracker.log(metrics, step))
        progress.update(f"reward {metrics['reward/mean']:.2f}")
    prof.stop()
    first = history[-1]
    first_indices = tr.last_indices
    last_batch = tr.last_batch
    assert last_batch is not None

    # reload the checkpoint taken before the last step and redo it: the numbers must be identical
    assert ckpt_path is not None
    state = ckpt.load(ckpt_path)
    redo_step = int(state["next_step"])
    tr.sampler.load_state_dict(state["sampler"])
    redo = tr.step(redo_step, _noop_profiler(cfg, out))
    progress.update("resume check")
    progress.close()
    resume: dict[str, Any] = {
        "checkpoint": str(ckpt_path),
        "step": redo_step,
        "loss": first["loss"],
        "loss_after_reload": redo["loss"],
        "grad_norm": first["grad_norm"],
        "grad_norm_after_reload": redo["grad_norm"],
        "same_prompts": tr.last_indices == first_indices,
        "identical": redo["loss"] == first["loss"] and redo["grad_norm"] == first["grad_norm"],
        "max_rel_diff": max(_rel(redo["loss"], first["loss"]), _rel(redo["grad_norm"], first["grad_norm"])),
    }
    # cpu: bit-identical. Accelerators: deterministic algorithms are on, but fused kernels may still
    # accumulate in a different order, so a relative difference up to RESUME_RTOL_ACCELERATOR passes.
    resume["ok"] = resume["same_prompts"] and (
        resume["identical"] or (device.is_accelerator and resume["max_rel_diff"] <= RESUME_RTOL_ACCELERATOR)
    )
    export = tr.export_and_compare(last_batch)
    tracker.close()
    summary: dict[str, Any] = {}
    if rank == 0:
        traces = sorted(str(p) for p in (out / "profile").rglob("*") if p.is_file())
        summary = {
            "config": cfg.to_dict(),
            "device": device.name,
            "device_model": device.model_name(),
            "world_size": world,
            "engine": tr.engine.name,
            "kernels": _kernel_names(),
            "param_dtype": tr.param_dtype,
            "parameters": tr.rollout.num_parameters(),
            "history": history,
            "learning": learning_summary(history),
            "data": {
                "path": str(tr.data_path),
                "samples": len(tr.dataset),
                "report": tr.dataset.report.describe(),
                "vocab_size": len(tr.tok),
                "epochs_started": tr.sampler.epoch + 1,
            },
            "resume": resume,
            "export": export,
            "traces": traces,
            "metrics_jsonl": str(tracker.jsonl_path),
            "tensorboard": str(tracker.tensorboard_dir) if "tensorboard" in backends else None,
            "notes": notes,
            "wall_s": time.perf_counter() - t_start,
        }
        _write_json(out / "summary.json", summary)
    tr.close()  # (on an exception the worker, a daemon process, ends with this process)
    if not resume["ok"]:
        raise CheckpointError(
            f"resume check failed: step {redo_step} after reloading {ckpt_path} gave loss "
            f"{redo['loss']!r} / grad norm {redo['grad_norm']!r}, first run {first['loss']!r} / "
            f"{first['grad_norm']!r}; the checkpoint does not restore the full training state"
        )
    tol = 1e-5 if tr.dtype == torch.float32 else 1e-2
    if rank == 0 and not export["max_abs_logit_diff"] <= tol:
        raise CheckpointError(
            f"HF export check failed: reloaded logits differ from the rollout copy by "
            f"{export['max_abs_logit_diff']:.3g} (> {tol}); see {export['path']}"
        )
    return summary


def learning_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """Mean ``reward/mean`` of the first and the last ``window = clamp(steps // 4, 1, 5)`` steps and
    their ratio (``inf`` when the first is 0 and the last is not)."""
    k = max(1, min(5, len(history) // 4))
    first = sum(h["reward/mean"] for h in history[:k]) / k
    last = sum(h["reward/mean"] for h in history[-k:]) / k
    ratio = last / first if first > 0 else (float("inf") if last > 0 else 1.0)
    return {"window": k, "reward_first": first, "reward_last": last, "ratio": ratio}


def _kernel_names() -> dict[str, str]:
    """What the registry selected for the kernels the engine uses (``auto`` choices resolved)."""
    from underlay import registry

    return {kind: registry.resolve(kind).name for kind in ("attention", "logprob")}


def _rel(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 when both are 0)."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def _noop_profiler(cfg: DemoConfig, out: Path) -> Profiler:
    """A profiler that records nothing, for the redone step (the trace already has its step)."""
    import underlay

    pcfg = ProfilerConfig(enabled=False, output_dir=str(out / "profile"))
    return underlay.get_profiler(pcfg, name=None if _env.get_optional("UNDERLAY_PROFILER") else "off")
