"""Multi-GPU checks of the FSDP2 engine under torchrun (issue 8); every rank runs the same command.

Modes (``--mode``):

- ``step``: one fp32 engine step of a tiny Llama and a tiny Qwen3-MoE on this world (dp = world / sp)
  against a float64 torch reference on the host (padded HF eager forward, token-mean loss, clip,
  AdamW); saves the stepped weights to ``$OUT/step_w{world}_sp{sp}.pt`` and, with ``--compare``
  naming another run's file, also compares the weights of both runs directly (2 ranks vs 1).
  ``--sp 2``: Ulysses size 2 (``ParallelConfig.ulysses``) (both ranks consume the same data): forward outputs (``infer``) and
  gradients (grad norm and the update) against the same reference.
- ``save``: one step, ``CheckpointManager.save`` to ``--ckpt``, then a second step whose loss and
  weights are written to ``--ckpt/expected.pt``.
- ``resume``: load ``--ckpt`` (saved at another world size) and run the second step: loss and weights
  must equal the saved expectation.

Writes ``$OUT/fsdp2_multigpu_<mode>_w<world>.json`` (rank 0) and prints one line per check;
exit status 1 when a check fails. fp32 on cuda (Triton's fp32 dots may use TF32): tolerance 2e-3.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.distributed import _fsdp_helpers as H

from underlay.interfaces import ParallelConfig

TOL = 2e-3


def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for b in engine.iter_weights() for n, t in b}


def step_mode(args: Any, dev: Any, rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    from underlay.engines.fsdp2.engine import FSDP2Engine

    res: dict[str, Any] = {}
    for arch, hf in (("llama", H.llama_config()), ("qwen3_moe", H.qwen3_moe_config())):
        ec = H.engine_config(copy.deepcopy(hf), parallel=ParallelConfig(ulysses=args.sp))
        engine = FSDP2Engine(ec, dev)
        sp = engine.layout.ulysses
        gb = H.global_batch(11)
        local = H.shard(gb, rank // sp, world // sp)
        inf = engine.infer(local, with_entropy=True)
        out = engine.forward_backward(local, H.pg_loss)
        st = engine.optimizer_step()
        w = weights(engine)
        ref = H.reference_model(copy.deepcopy(hf), 0)
        with torch.no_grad():
            ref_out = H.reference_outputs(ref, local)
        loss, norm, ref_w = H.reference_step(ref, gb, ec)
        res[f"{arch}_infer_logp"] = float((inf.log_probs.double().cpu() - ref_out.log_probs).abs().max())
        res[f"{arch}_loss"] = abs(out.metrics["loss"] - loss)
        res[f"{arch}_grad_norm"] = abs(st.grad_norm - norm)
        res[f"{arch}_weights"] = H.max_diff(w, ref_w)
        if rank == 0:
            torch.save(w, out_dir / f"step_{arch}_w{world}_sp{sp}.pt")
        if args.compare:
            other = torch.load(Path(args.compare) / f"step_{arch}_w1_sp1.pt", weights_only=True)
            res[f"{arch}_vs_1rank"] = H.max_diff(w, other)
        del engine
    return res


def save_mode(args: Any, dev: Any, rank: int, world: int) -> dict[str, Any]:
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine

    engine = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    engine.forward_backward(H.shard(H.global_batch(1), rank, world), H.pg_loss)
    engine.optimizer_step()
    CheckpointManager(args.ckpt, engine).save(1, {"world": world})
    r2 = engine.forward_backward(H.shard(H.global_batch(2), rank, world), H.pg_loss)
    engine.optimizer_step()
    w = weights(engine)
    if rank == 0:
        torch.save({"loss2": r2.metrics["loss"], "w2": w}, Path(args.ckpt) / "expected.pt")
    return {"saved": 1.0}


def resume_mode(args: Any, dev: Any, rank: int, world: int) -> dict[str, Any]:
    from underlay.checkpoint import CheckpointManager
    from underlay.engines.fsdp2.engine import FSDP2Engine

    engine = FSDP2Engine(H.engine_config(H.llama_config()), dev)
    state = CheckpointManager(args.ckpt, engine).load()
    expected = torch.load(Path(args.ckpt) / "expected.pt", weights_only=True)
    r2 = engine.forward_backward(H.shard(H.global_batch(2), rank, world), H.pg_loss)
    engine.optimizer_step()
    return {
        "saved_world": float(state["world"]),
        "resume_loss": abs(r2.metrics["loss"] - expected["loss2"]),
        "resume_weights": H.max_diff(weights(engine), expected["w2"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("step", "save", "resume"), required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--compare", default=None, help="directory holding a 1-rank step run's weights")
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    from underlay.parallel.distributed import init_distributed
    from underlay.registry import get_device

    dev = get_device(args.device)
    env = init_distributed(dev)
    rank, world = env.rank, env.world_size
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.mode == "step":
        res = step_mode(args, dev, rank, world, out_dir)
    elif args.mode == "save":
        res = save_mode(args, dev, rank, world)
    else:
        res = resume_mode(args, dev, rank, world)
    ok = all(v < TOL for k, v in res.items() if k not in ("saved", "saved_world"))
    flag = torch.tensor([0.0 if ok else 1.0], device=dev.torch_device() if dev.is_accelerator else "cpu")
    dist.all_reduce(flag)
    if rank == 0:
        tag = f"sp{args.sp}_" if args.sp > 1 else ""
        for k, v in res.items():
            print(f"{args.mode} world={world} sp={args.sp} {k}: {v:.3e}")
        print(f"{args.mode} world={world} sp={args.sp}: {'PASS' if float(flag) == 0 else 'FAIL'}")
        path = out_dir / f"fsdp2_multigpu_{args.mode}_{tag}w{world}.json"
        path.write_text(json.dumps({"results": res, "ok": float(flag) == 0, "world": world}, indent=2))
    dist.destroy_process_group()
    return 0 if float(flag) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
