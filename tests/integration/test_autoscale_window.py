"""A cluster that grows under a running pipeline (an autoscaler adding nodes): the iterator's
window of read tasks is sized again at each epoch and within one, not kept at what the first
one saw."""

from __future__ import annotations

import numpy as np
import pytest

import raying
from raying.options import DEFAULT_INFLIGHT_STORE_SHARE


@pytest.fixture
def cluster():
    """A head of one CPU, Ray connected to it; nodes are added by the test."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    made = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 128 * 1024**2})
    try:
        ray.init(address=made.address, log_to_driver=False)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


def _grow(cluster) -> None:
    cluster.add_node(num_cpus=2, object_store_memory=128 * 1024**2)
    cluster.wait_for_nodes()


def test_the_read_window_grows_with_the_cluster(image_folder, cluster):
    import ray

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    try:
        ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=8, epoch=0)])
        assert sorted(ids.tolist()) == list(range(len(m)))
        assert pipe._stream._window == 2  # one CPU: max(2, 2 per CPU)
        _grow(cluster)
        ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=8, epoch=1)])
        assert sorted(ids.tolist()) == list(range(len(m)))
        assert pipe._stream._window == 6  # three CPUs now
        store = ray.cluster_resources()["object_store_memory"]
        assert pipe._stream._budget == int(store * DEFAULT_INFLIGHT_STORE_SHARE)
    finally:
        pipe.close()


def test_the_read_window_grows_within_an_epoch(image_folder, cluster, monkeypatch):
    """Nodes added in the middle of a long epoch get read tasks before the epoch ends."""
    from raying.loader import pipeline as _pipeline

    monkeypatch.setattr(_pipeline, "WINDOW_REFIT_S", 0.0)  # look at every block
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    pipe = pipe.map_batches(_slow)  # an epoch long enough for the node to come up
    try:
        batches = pipe.iter_batches(batch_size=8, epoch=0)
        ids = [next(batches)["id"]]
        assert pipe._stream._window == 2  # one CPU: max(2, 2 per CPU)
        _grow(cluster)
        windows = []
        for b in batches:
            ids.append(b["id"])
            windows.append(pipe._stream._window)
        assert windows[-1] == 6  # three CPUs, within epoch 0
        assert sorted(np.concatenate(ids).tolist()) == list(range(len(m)))
    finally:
        pipe.close()


def _slow(batch):
    import time

    time.sleep(0.5)
    return batch
