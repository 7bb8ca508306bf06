"""A 3-node local cluster: decode spread over nodes, trainers on the GPU-standing nodes.

Head: 1 CPU (driver, priority store). Two worker nodes: 2 CPUs and one ``trainer`` resource
each, standing in for a GPU. The Train job of jobs/train_torch.py runs in this process.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_job(name: str):
    spec = importlib.util.spec_from_file_location(f"raying_job_{name}", REPO / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle ships it by value (see the job)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    store_mb = 128 * 1024**2
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": store_mb})
    trainers = [cluster.add_node(num_cpus=2, resources={"trainer": 1},
                                 labels={"raying/role": "trainer"},
                                 object_store_memory=store_mb) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, [n.node_id for n in trainers]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_train_job_on_three_nodes(three_nodes, tmp_path):
    import ray

    from raying.sampling import store as st

    cluster, trainer_nodes = three_nodes
    head_node = cluster.head_node.node_id
    job = _load_job("train_torch")
    args = job.build_parser().parse_args(["--smoke-test", "--trainer-resource", "trainer",
                                          "--storage-path", str(tmp_path / "train")])
    out = job.fit(args)
    summary, records, handle = out["summary"], out["records"], out["store"]

    # Decode ran on more than one node.
    read_nodes = summary["decode_rows_by_node"]
    assert len(read_nodes) > 1 and all(rows > 0 for rows in read_nodes.values()), read_nodes
    # Both Train workers sat on the GPU-standing nodes, one each.
    assert sorted(summary["worker_nodes"].values()) == sorted(trainer_nodes)
    # Across workers every id came exactly once per epoch, and each worker read its share.
    for epoch, cov in summary["epochs"].items():
        assert cov["exactly_once"] is True, (epoch, cov)
        assert all(rows > 0 for rows in cov["rows_by_rank"].values()), cov
    # Both workers' losses reached the store: after the last epoch each id holds the loss
    # its worker reported, so per worker the stored priorities add up to its loss sum.
    last = max(r["epoch"] for r in records)
    for r in (r for r in records if r["epoch"] == last):
        stored = st.priorities(handle, r["ids"])
        assert stored.sum() == pytest.approx(r["loss_sum"], rel=1e-4), r["rank"]
        assert not np.any(stored == 1.0), "an id kept its initial priority"
    assert summary["store"]["updates_received"] == 2 * summary["samples"]

    # The store lives apart from the trainers: on the head, and it restarts on its own.
    from ray._private import state as gcs_state

    actor_id = handle.actors[0]._actor_id.hex()
    assert gcs_state.actors(actor_id)["Address"]["NodeID"] == head_node
    before = st.priorities(handle)
    ray.kill(handle.actors[0], no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            st.stats(handle)
            break
        except Exception:  # noqa: BLE001 - restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert len(st.priorities(handle)) == len(before)
    out["pipe"].close()


def test_a_train_job_on_several_nodes_without_storage_path_stops_before_it_reads(three_nodes):
    # Ray Train would refuse the local default at the first checkpoint of a worker on another
    # node, after an epoch's work: the job says so at once, with the fix.
    job = _load_job("train_torch")
    args = job.build_parser().parse_args(["--smoke-test", "--trainer-resource", "trainer"])
    with pytest.raises(SystemExit, match="3 nodes.*pass --storage-path"):
        job.fit(args)
