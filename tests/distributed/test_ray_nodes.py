"""Worker groups over several Ray nodes, and a lost node, with ``ray.cluster_utils.Cluster`` (several
raylets on this machine, each a node of one cluster)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from underlay.launch.ray import RankFailure, WorkerGroup  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head without CPUs and two nodes of one CPU each, so a 2-rank group spans both nodes."""
    if ray.is_initialized():
        ray.shutdown()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + ([old] if old else []))
    c = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 2**20},
    )
    nodes = [c.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _where() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {"sum": float(t.item()), **{k: os.environ[k] for k in keys}}


def _wait_in_barrier() -> None:
    import torch.distributed as dist

    while True:
        dist.barrier()
        time.sleep(0.05)


def test_group_spans_nodes_and_a_lost_node_is_reported(cluster: Any) -> None:
    c, nodes = cluster
    g = WorkerGroup(2, device="cpu", name="two-nodes", collective_timeout_s=600)
    infos = g.ranks
    assert infos[0].node_id != infos[1].node_id  # one CPU per node: the ranks are on different nodes
    got = g.run(_where)
    assert [x["sum"] for x in got] == [3.0, 3.0]
    assert [x["RANK"] for x in got] == ["0", "1"]
    assert [x["LOCAL_RANK"] for x in got] == ["0", "0"] and [x["LOCAL_WORLD_SIZE"] for x in got] == ["1", "1"]
    assert got[0]["MASTER_ADDR"] == got[1]["MASTER_ADDR"] == infos[0].node_ip

    # lose the node of rank 1 while both ranks are inside collectives
    victim = next(n for n in nodes if n.node_id == infos[1].node_id)
    refs = g.submit(_wait_in_barrier)
    time.sleep(1.0)
    c.remove_node(victim)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        g.get(refs, what="the barrier loop")
    assert time.monotonic() - t0 < 90
    assert err.value.rank == 1 and "died" in err.value.cause
    assert not g.alive
    live = [p for p, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]
    assert not live
