"""Ranks as Ray actors (``underlay.launch.ray``) on a local CPU Ray started once for this module.

GPUs and NPUs are stood in for by Ray resources declared on the local node (``num_gpus=2``,
``resources={"NPU": 2}``): Ray hands out their ids and sets ``CUDA_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES`` exactly as on an accelerator node, while the ranks compute on the cpu
(gloo). ``FAKE_ACCEL`` is a custom resource without device ids.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from tests._dist import run_distributed  # noqa: E402
from tests.distributed._fsdp_helpers import engine_config, global_batch, llama_config, pg_loss  # noqa: E402
from underlay.interfaces import ConfigError, InvalidInput, ParallelConfig, ParallelLayout  # noqa: E402
from underlay.launch.ray import (  # noqa: E402
    RankFailure,
    RankResources,
    ResourcePool,
    WorkerGroup,
    detached_groups,
    dispatch_batch,
    dp_coordinates,
    gather_outputs,
    remove_detached,
    split_batch,
)

pytestmark = [pytest.mark.ray, pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CPUS = 4
# the Ulysses size is being renamed from ``sp`` to ``ulysses``; these tests take whichever exists
ULYSSES = "ulysses" if "ulysses" in {f.name for f in dataclasses.fields(ParallelConfig)} else "sp"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """A local Ray for the whole module: 4 CPU slots, 2 stand-in GPUs, 2 stand-in NPUs, 2 FAKE_ACCEL."""
    if ray.is_initialized():
        ray.shutdown()
    # the ranks import underlay and the test helpers from this checkout
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + ([old] if old else []))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for attempt in range(3):
        try:
            ray.init(
                num_cpus=CPUS,
                num_gpus=2,
                resources={"NPU": 2, "FAKE_ACCEL": 2},
                include_dashboard=False,
                object_store_memory=96 * 2**20,
                log_to_driver=False,
            )
            break
        except Exception as exc:
            # Ray gives its raylet a fixed 30 s to register; an overloaded host can miss that once
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    try:
        yield
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _all_free(timeout_s: float = 30.0) -> bool:
    """Every resource of the cluster available again (no leaked actor or placement group)."""
    keys = ("CPU", "GPU", "NPU", "FAKE_ACCEL")
    total = {k: v for k, v in ray.cluster_resources().items() if k in keys}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = {k: v for k, v in ray.available_resources().items() if k in keys}
        if all(abs(free.get(k, 0.0) - v) < 1e-6 for k, v in total.items()):
            return True
        time.sleep(0.5)
    return False


def _live_placement_groups() -> list[str]:
    return [pid for pid, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


# ----------------------------------------------------------------------- pure dispatch helpers


def test_dp_coordinates_follow_engine_rank_order() -> None:
    # fsdp2: data mesh (dp, ulysses), ulysses ranks consecutive
    lay = ParallelLayout.infer(8, **{ULYSSES: 2})
    assert [dp_coordinates(r, lay) for r in range(8)] == [(r // 2, 4) for r in range(8)]
    # megatron order tp-cp-ep-dp-pp: tp fastest, then cp, then dp, pp slowest
    lay = ParallelLayout.infer(16, tp=2, cp=2, pp=2)
    got = [dp_coordinates(r, lay)[0] for r in range(16)]
    assert got == [(r // 4) % 2 for r in range(16)]
    with pytest.raises(InvalidInput, match="outside"):
        dp_coordinates(16, lay)


@pytest.mark.parametrize("n", [4, 5, 7, 8, 9])
def test_dispatch_gather_preserve_order_uneven(n: int) -> None:
    batch = global_batch(seed=n, n=n)
    lay = ParallelLayout.infer(6, **{ULYSSES: 2})  # 3 shares, 2 ranks each
    shares = dispatch_batch(batch, lay)
    sizes = [s.batch_size for s in split_batch(batch, 3)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    for r in range(6):
        assert shares[r] is shares[(r // 2) * 2]  # ranks of one Ulysses group share the rows
    # each rank "computes" a per-token function of its rows; gathering must give that of the batch
    from underlay.interfaces import TokenOutputs

    outs = [TokenOutputs(s.input_ids.double() * 3, values=s.loss_mask.double()) for s in shares]
    got = gather_outputs(outs, lay)
    assert torch.equal(got.log_probs, batch.input_ids.double() * 3)
    assert torch.equal(got.values, batch.loss_mask.double()) and got.entropy is None
    with pytest.raises(InvalidInput, match="cannot be split"):
        split_batch(global_batch(0, n=2), 3)


def test_object_store_transport_is_zero_copy_and_keeps_dtypes() -> None:
    from underlay.launch.ray import _Wire, _WireBatch

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        t = (torch.randn(5, 7, generator=g) * 100).to(dtype)
        wire = ray.get(ray.put(_Wire.of(t)))
        assert not wire.array.flags.writeable  # a view of Ray's shared memory, not a pickled copy
        back = wire.tensor()
        assert back.dtype == dtype and torch.equal(back, t)
        back.add_(1)  # the copy handed to an engine is private and writable
    batch = global_batch(seed=5, n=5)
    got = ray.get(ray.put(_WireBatch.of(batch))).batch()
    assert torch.equal(got.input_ids, batch.input_ids) and torch.equal(got.loss_mask, batch.loss_mask)
    assert torch.equal(got.extras["advantages"], batch.extras["advantages"])
    # a vision-language batch keeps its images and videos
    from underlay.interfaces import VisionInputs

    images = VisionInputs(
        torch.randn(32, 12, generator=g), torch.tensor([[1, 4, 4]] * 2), torch.tensor([0, 3])
    )
    videos = VisionInputs(
        torch.randn(16, 12, generator=g), torch.tensor([[1, 4, 4]]), torch.tensor([2]), torch.tensor([0.5])
    )
    vl = dataclasses.replace(batch, images=images, videos=videos)
    got = ray.get(ray.put(_WireBatch.of(vl))).batch()
    assert got.images is not None and got.videos is not None and got.videos.second_per_grid is not None
    assert torch.equal(got.images.pixel_values, images.pixel_values) and torch.equal(
        got.images.rows, images.rows
    )
    assert torch.equal(got.videos.grid_thw, videos.grid_thw) and float(got.videos.second_per_grid[0]) == 0.5


# --------------------------------------------------------------------------- bad input


def test_bad_input_refused_before_any_actor_starts() -> None:
    before = set(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match=r"CPU: needs 9, cluster has 4"):
        WorkerGroup(9, device="cpu")
    with pytest.raises(ConfigError, match=r"no resource 'TPU_V9'"):
        WorkerGroup(2, device="cpu", resources=RankResources("TPU_V9", None))
    with pytest.raises(ConfigError, match=r"GPU: needs 3, cluster has 2"):
        WorkerGroup(3, device="cpu", resources=RankResources("GPU", "CUDA_VISIBLE_DEVICES"))
    cfg = engine_config(llama_config(), parallel=ParallelConfig(**{ULYSSES: 3}))
    with pytest.raises(ConfigError, match=r"engine 'actor'.*3"):
        WorkerGroup(2, device="cpu", engines={"actor": cfg})
    cfg = engine_config(llama_config(), parallel=ParallelConfig(dp_replicate=3))
    with pytest.raises(ConfigError, match=r"not divisible"):
        WorkerGroup(2, device="cpu", engines={"actor": cfg})
    with pytest.raises(InvalidInput, match="world_size"):
        WorkerGroup(0, device="cpu")
    assert set(ray.util.placement_group_table()) == before  # no placement group was even created
    assert _all_free(5.0)


# ------------------------------------------------------------- accelerator stand-ins, local rank


def _rank_env() -> dict[str, Any]:
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        **{
            k: os.environ.get(k)
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
        },
    }


@pytest.mark.parametrize(
    ("resource", "env"),
    [("GPU", "CUDA_VISIBLE_DEVICES"), ("NPU", "ASCEND_RT_VISIBLE_DEVICES"), ("FAKE_ACCEL", None)],
)
def test_accelerator_bundles_visible_devices_and_local_rank(resource: str, env: str | None) -> None:
    with WorkerGroup(2, device="cpu", resources=RankResources(resource, env), name=f"acc-{resource}") as g:
        infos = g.ranks
        got = g.run(_rank_env)
        pg_bundles = [
            pg["bundles"] for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"
        ]
        assert [{"CPU": 1.0, resource: 1.0}] * 2 in [list(b.values()) for b in pg_bundles]
    assert [i.rank for i in infos] == [0, 1] and {i.node_ip for i in infos} == {infos[0].node_ip}
    assert [i.local_rank for i in infos] == [0, 1]
    for r, (info, e) in enumerate(zip(infos, got)):
        assert (e["rank"], e["world"], e["RANK"], e["WORLD_SIZE"]) == (r, 2, str(r), "2")
        assert e["LOCAL_RANK"] == str(info.local_rank)
        if env is None:  # no device ids: local rank by order on the node, no visible-devices variable
            assert info.accelerator_ids == () and info.visible_devices is None
        else:  # every rank sees its node's devices of the group; LOCAL_RANK indexes its own id
            assert sorted(i.accelerator_ids[0] for i in infos) == ["0", "1"]
            assert e[env] == "0,1" == info.visible_devices
            assert info.local_rank == int(info.accelerator_ids[0])
    assert _all_free() and not _live_placement_groups()


# ------------------------------------------------------------- fsdp2 through Ray == torchrun style

STEP_ROWS = 7  # uneven over 2 ranks


def _torchrun_step(rank: int, world: int) -> dict[str, Any]:
    import underlay

    batch = global_batch(seed=11, n=STEP_ROWS)
    share = split_batch(batch, world)[rank]
    engine = underlay.get_engine(engine_config(llama_config()))
    res = engine.forward_backward(share, pg_loss)
    opt = engine.optimizer_step()
    out = engine.infer(share, with_entropy=True)
    return {
        "metrics": dict(res.metrics),
        "grad_norm": opt.grad_norm,
        "log_probs": out.log_probs,
        "entropy": out.entropy,
    }


_REFERENCE: list[Any] = []


def _torchrun_reference() -> list[dict[str, Any]]:
    """``_torchrun_step`` on 2 processes, computed once for the module (two tests compare to it)."""
    if not _REFERENCE:
        _REFERENCE.extend(run_distributed(_torchrun_step, 2, timeout_s=240))
    return list(_REFERENCE)


def _threads_and_niceness() -> tuple[int, int]:
    return torch.get_num_threads(), os.nice(0)


def test_rank_threads_follow_the_cpu_reservation_and_ranks_are_not_niced() -> None:
    # OMP_NUM_THREADS of the environment Ray was started from (here: set at process start) reaches
    # the actors; a rank must still compute with the CPUs it reserved, or its CPU kernels reduce in
    # another order than a torchrun rank's (the Ray-vs-torchrun comparison below then differs).
    # Ray starts its workers at niceness 15: a rank runs at 0, or any busy process of the host starves
    # it (each other lane of this suite did, about 30 to 1). Negative control, run once: a group with
    # env={"RAY_worker_niceness": "15"} reads 15 here (and takes minutes to start beside the other lanes).
    # (one rank per group: both are per-rank properties; each rank is a process to start)
    with WorkerGroup(1, device="cpu", name="threads", env={"OMP_NUM_THREADS": "3"}) as g:
        assert g.run(_threads_and_niceness) == [(1, 0)]
    two_cpus = RankResources(None, None, 2.0)
    with WorkerGroup(1, device="cpu", name="threads2", resources=two_cpus, env={"OMP_NUM_THREADS": "3"}) as g:
        assert g.run(_threads_and_niceness) == [(2, 0)]
        # a call past its timeout names the rank and this host's load (starved or stuck?)
        with pytest.raises(
            RankFailure, match=r"rank 0 of 1 .* no answer within 0.5 s \(this host: load average"
        ):
            g.get(g.submit(time.sleep, 30), timeout_s=0.5, what="a sleep")
        assert not g.alive
    assert _all_free() and not _live_placement_groups()


@pytest.fixture(scope="module")
def pool_step() -> dict[str, Any]:
    """An actor and a reference engine group sharing one 2-bundle pool (share 0.5 each), taking turns:
    the reference infers, the actor steps and infers (its turn), the reference infers again (its turn).
    Run once for the two tests below: its ranks are the only engine-building Ray actors of the pair of
    tests (each such actor imports the engine stack, most of what these tests cost)."""
    batch = global_batch(seed=11, n=STEP_ROWS)
    cfg = engine_config(llama_config())
    out: dict[str, Any] = {}
    with ResourcePool(2, device="cpu", name="shared") as pool:
        actor_g = WorkerGroup(2, device="cpu", pool=pool, share=0.5, name="actor", engines={"actor": cfg})
        ref_g = WorkerGroup(2, device="cpu", pool=pool, share=0.5, name="ref", engines={"reference": cfg})
        actor, ref = actor_g.engine("actor"), ref_g.engine("reference")
        out["layout"] = (actor.layout.world_size, actor.layout.dp)
        out["before"] = ref.infer(batch)
        with pool.colocated(actor):
            out["res"] = actor.forward_backward(batch, pg_loss)
            out["opt"] = actor.optimizer_step()
            out["out"] = actor.infer(batch, with_entropy=True)
        out["ref_log_after_actor_turn"] = ref_g.call_log()[-1][:2]
        out["actor_turns"] = [m for r, m, _ in actor_g.call_log() if m in ("offload", "onload")]
        with pool.colocated(ref):
            out["after"] = ref.infer(batch)
        with pool.colocated(ref):  # a second turn of the same role moves nothing
            pass
        out["turns"] = [
            (r, m) for r, m, _ in actor_g.call_log() + ref_g.call_log() if m in ("offload", "onload")
        ]
    out["released"] = _all_free() and not _live_placement_groups()
    return out


@pytest.mark.slow
def test_fsdp2_step_through_ray_equals_torchrun_processes(pool_step: dict[str, Any]) -> None:
    # both sides compute with one intra-op thread per rank (run_distributed sets 1; a Ray rank takes
    # the one CPU of its half bundle), so the comparison is exact
    ref = _torchrun_reference()
    res, opt, out = pool_step["res"], pool_step["opt"], pool_step["out"]
    assert pool_step["layout"] == (2, 2)
    assert res.metrics == ref[0]["metrics"] and opt.grad_norm == ref[0]["grad_norm"]
    want_lp = torch.cat([ref[0]["log_probs"], ref[1]["log_probs"]])
    want_ent = torch.cat([ref[0]["entropy"], ref[1]["entropy"]])
    assert out.log_probs.shape == (STEP_ROWS, global_batch(seed=11, n=STEP_ROWS).input_ids.shape[1])
    assert torch.equal(out.log_probs, want_lp) and torch.equal(out.entropy, want_ent)
    assert pool_step["released"]


# ------------------------------------------------------------------------------- failures


def _wait_in_barrier() -> None:
    import torch.distributed as dist

    while True:  # every rank blocks in collectives until the group is torn down
        dist.barrier()
        time.sleep(0.05)


def _raise_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise ValueError("bad advantages on rank one")
    dist.barrier()  # rank 0 would wait here for the collective timeout without the controller
    return 0


def _all_reduce_ranks() -> float:
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


@pytest.mark.slow
def test_failures_surface_within_bounded_time_and_group_restarts() -> None:
    # a killed process: rank 1 is SIGKILLed while every rank is inside collectives
    g = WorkerGroup(2, device="cpu", name="kill", collective_timeout_s=600)
    victim = g.ranks[1]
    refs = g.submit(_wait_in_barrier)
    time.sleep(1.0)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        g.get(refs, what="the barrier loop")
    took = time.monotonic() - t0
    assert took < 30, took
    err = info.value
    assert err.rank == 1 and victim.node_ip in err.host and str(victim.pid) in err.host
    assert "died" in err.cause and "rank 1 of 2" in str(err) and "barrier loop" in str(err)
    assert not g.alive
    assert _all_free() and not _live_placement_groups()

    # a new group in the same driver works; then an exception on one of its ranks while the other
    # waits in a collective (600 s collective timeout) surfaces within seconds
    g = WorkerGroup(2, device="cpu", name="again", collective_timeout_s=600)
    assert g.run(_all_reduce_ranks) == [3.0, 3.0]
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 on .* ValueError: bad advantages on rank one"):
        g.run(_raise_on_rank_one)
    assert time.monotonic() - t0 < 30
    assert not g.alive
    assert _all_free() and not _live_placement_groups()


# ------------------------------------------------------------------------------ colocated roles


def _example() -> Any:
    path = ROOT / "examples" / "ray_roles.py"
    spec = importlib.util.spec_from_file_location("underlay_example_ray_roles", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_colocated_roles_alternate_and_match_separate_groups() -> None:
    ex = _example()
    colo = ex.run("colocated", world_size=2, steps=2, device="cpu")
    assert _all_free() and not _live_placement_groups()
    sep = ex.run("separate", world_size=2, steps=2, device="cpu")
    assert _all_free() and not _live_placement_groups()
    for a, b in zip(colo["history"], sep["history"]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    compute = [(role, m, res) for role, m, res in colo["call_log"] if m not in ("offload", "onload")]
    assert [(r, m) for r, m, _ in compute][:4] == [
        ("reference", "infer"),
        ("critic", "infer"),
        ("actor", "forward_backward"),
        ("actor", "optimizer_step"),
    ]
    for role, method, resident in compute:  # the active role alone holds the device
        assert resident == (role,), (role, method, resident)
    turns = [(r, m) for r, m, _ in colo["call_log"] if m in ("offload", "onload")]
    assert ("actor", "offload") in turns and ("actor", "onload") in turns
    for role in ("actor", "reference", "critic"):  # built on the device; then strictly off, on, off, ...
        seq = [m for r, m in turns if r == role]
        assert seq == ["offload", "onload"] * (len(seq) // 2) + ["offload"] * (len(seq) % 2), (role, seq)


# ------------------------------------------------------------------------------ demo on Ray


@pytest.mark.slow
def test_demo_with_ray_launcher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from underlay import cli
    from underlay.checkpoint import latest

    out = tmp_path / "out"
    argv = ["demo", "--launcher", "ray", "--steps", "2", "--world-size", "2", "--prompts-per-step", "2"]
    argv += ["--responses-per-prompt", "2", "--max-new-tokens", "4", "--out-dir", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "ranks as Ray actors" in printed
    assert "-> identical" in printed and "tokenizer round trip ok" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["engine"] == "fsdp2"
    res, exp = summary["resume"], summary["export"]
    assert res["identical"] and res["step"] == 1
    assert latest(out / "checkpoints") == Path(res["checkpoint"])
    assert exp["max_abs_logit_diff"] <= 1e-5 and exp["max_abs_logprob_diff_vs_engine"] <= 1e-4
    assert _all_free() and not _live_placement_groups()


def test_demo_ray_launcher_refuses_bad_input_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from underlay import cli

    # 3 prompts do not split over 2 ranks: refused before any actor starts, as with the torch launcher
    argv = ["demo", "--launcher", "ray", "--steps", "2", "--world-size", "2", "--prompts-per-step", "3"]
    assert cli.main([*argv, "--out-dir", str(tmp_path)]) == 2
    assert "does not split over 2" in capsys.readouterr().err
    assert not _live_placement_groups()


# ------------------------------------------------------------------- pools and detached groups


def _threads_and_pid() -> tuple[int, int]:
    return torch.get_num_threads(), os.getpid()


def test_pool_splits_and_shares_bundles_and_refuses_overcommit_before_starting() -> None:
    with pytest.raises(ConfigError, match="more than the cluster has"):
        ResourcePool(CPUS + 1, device="cpu")
    with pytest.raises(ConfigError, match="without a pool"):
        WorkerGroup(1, device="cpu", share=0.5)
    with ResourcePool(2, device="cpu", name="split") as pool:
        assert len(_live_placement_groups()) == 1
        with pytest.raises(InvalidInput, match="adding up to at most 2"):
            pool.split([2, 1])
        a, b = pool.split([1, 1])
        ga = WorkerGroup(1, device="cpu", pool=a, name="rollout")
        gb = WorkerGroup(1, device="cpu", pool=b, name="critic")
        assert (ga.ranks[0].bundle, gb.ranks[0].bundle) == (0, 1)
        assert pool.shares_used() == [1.0, 1.0]
        assert len(_live_placement_groups()) == 1  # the groups placed no groups of their own
        with pytest.raises(ConfigError, match="bundle 0 has 0 left"):
            WorkerGroup(1, device="cpu", pool=pool, share=0.5, name="over")
        with pytest.raises(ConfigError, match="detached"):
            WorkerGroup(1, device="cpu", pool=pool, detached=True)
        with pytest.raises(ConfigError, match="world_size=2 > the 1 bundles"):
            WorkerGroup(2, device="cpu", pool=a)
        assert pool.shares_used() == [1.0, 1.0]
        ga.shutdown()
        assert pool.shares_used() == [0.0, 1.0]
        # two halves of bundle 0: both live, each computing with one thread, in two processes
        h1 = WorkerGroup(1, device="cpu", pool=pool.slice(0, 1), share=0.5, name="half1")
        h2 = WorkerGroup(1, device="cpu", pool=pool.slice(0, 1), share=0.5, name="half2")
        (t1, p1), (t2, p2) = h1.run(_threads_and_pid)[0], h2.run(_threads_and_pid)[0]
        assert (t1, t2) == (1, 1) and p1 != p2 and h1.ranks[0].bundle == h2.ranks[0].bundle == 0
        assert pool.shares_used() == [1.0, 1.0]
    assert not gb.alive and not h1.alive and not h2.alive  # the pool's shutdown ended its groups
    assert _all_free() and not _live_placement_groups()


@pytest.mark.slow
def test_actor_and_reference_share_one_pool_and_take_turns(pool_step: dict[str, Any]) -> None:
    want = _torchrun_reference()[0]
    assert pool_step["ref_log_after_actor_turn"] == ("reference", "offload")
    assert pool_step["actor_turns"] == []
    assert pool_step["turns"] == [("actor", "offload"), ("reference", "offload"), ("reference", "onload")]
    # actor's step equals the torchrun processes' (one thread per rank on both sides: exact);
    # the reference, offloaded and back, did not change
    res, opt = pool_step["res"], pool_step["opt"]
    assert res.metrics == want["metrics"] and opt.grad_norm == want["grad_norm"]
    before, after = pool_step["before"], pool_step["after"]
    assert before.log_probs is not None and after.log_probs is not None
    assert torch.equal(before.log_probs, after.log_probs)
    assert pool_step["released"]


DRIVER = """
import json, sys, ray, torch
from tests.distributed._fsdp_helpers import global_batch
from underlay.launch.ray import WorkerGroup
ray.init(address=sys.argv[1], log_to_driver=False)
g = WorkerGroup.attach(sys.argv[2])
out = g.engine("actor").infer(global_batch(seed=3, n=3))
print(json.dumps({"log_probs": out.log_probs.tolist(), "roles": sorted(g._layouts), "world": g.world_size}))
"""


@pytest.mark.slow
def test_detached_group_outlives_its_driver_and_a_new_driver_attaches() -> None:
    name = "detached-actor"
    g = WorkerGroup(
        1, device="cpu", name=name, detached=True, engines={"actor": engine_config(llama_config())}
    )
    want = g.engine("actor").infer(global_batch(seed=3, n=3)).log_probs
    with pytest.raises(ConfigError, match="is alive"):
        WorkerGroup(1, device="cpu", name=name, detached=True)
    del g  # this driver lets go of its handle; the named actors stay
    assert name in detached_groups()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, address, name], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["roles"] == ["actor"] and got["world"] == 1
    assert want is not None and torch.equal(torch.tensor(got["log_probs"]), want)
    # the other driver has exited: the group is still there for a third attach, then removed
    assert name in detached_groups()
    again = WorkerGroup.attach(name)
    assert again.ranks[0].pid > 0 and again._resident == {"actor": True}
    remove_detached(name)
    assert name not in detached_groups()
    with pytest.raises(InvalidInput, match="no detached worker group"):
        WorkerGroup.attach(name)
    assert _all_free() and not _live_placement_groups()
