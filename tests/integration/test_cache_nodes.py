"""The decoded cache on a 3-node local cluster: each node's own copy, freed on every node.

The nodes of ``ray.cluster_utils.Cluster`` share this host's /dev/shm, so each node gets its
own decoded-cache root through its environment (``RAYING_DECODED_CACHE_DIR``, read where the
read task runs): a file left on one node cannot hide behind another's.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from raying.read import decoded_dirs
from raying.read.memory import dir_bytes

_MB = 1024 * 1024
_NODES = ("head", "n1", "n2")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from raying.tools.datagen import make_image_folder

    if ray.is_initialized():
        ray.shutdown()
    base = f"/dev/shm/raying-test-nodes-{uuid.uuid4().hex[:8]}"
    roots = {name: os.path.join(base, name) for name in _NODES}
    store = 128 * _MB
    old = os.environ.get(decoded_dirs.DECODED_CACHE_DIR_ENV)
    os.environ[decoded_dirs.DECODED_CACHE_DIR_ENV] = roots["head"]  # the driver's node
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": store,
        "env_vars": {decoded_dirs.DECODED_CACHE_DIR_ENV: roots["head"]}})
    for name in _NODES[1:]:
        cluster.add_node(num_cpus=1, object_store_memory=store,
                         env_vars={decoded_dirs.DECODED_CACHE_DIR_ENV: roots[name]})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    folder = make_image_folder(tmp_path_factory.mktemp("nodes-images"), n=96, classes=3,
                               size=(96, 128), seed=4)
    try:
        yield cluster, roots, folder
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
        if old is None:
            os.environ.pop(decoded_dirs.DECODED_CACHE_DIR_ENV, None)
        else:
            os.environ[decoded_dirs.DECODED_CACHE_DIR_ENV] = old


def _pipeline(folder, name: str, *, cached: bool = True):
    import raying

    return raying.Pipeline(raying.Manifest.scan(str(folder)),
                           transform=raying.ImageTransform(size=32),
                           config=raying.PipelineConfig(name=name, block_rows=8, spread=True,
                                                        decoded_cache=32 * _MB if cached
                                                        else "off",
                                                        decoded_cache_fill=None))


def _level(roots: dict[str, str]) -> dict[str, float]:
    return {name: dir_bytes(path) / _MB for name, path in roots.items()}


def test_close_frees_the_decoded_pixels_on_every_node(nodes):
    _, roots, folder = nodes
    before = _level(roots)
    name = f"nodes-close-{uuid.uuid4().hex[:6]}"
    pipe = _pipeline(folder, name)
    for epoch in (0, 1):
        rows = sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=epoch))
        assert rows == 96
    name = pipe._cache_name  # the pipeline's name and its own suffix
    held = {node: dir_bytes(os.path.join(root, name)) for node, root in roots.items()}
    # Reads ran on every node (SPREAD), and each cached what it decoded in its own tmpfs.
    assert sum(1 for b in held.values() if b > 0) >= 2, held
    # Every node that cached pixels recorded the driver as their owner.
    for node, root in roots.items():
        if held[node]:
            with open(os.path.join(root, name, ".owner")) as fh:
                assert fh.read().split()[1] == str(os.getpid()), node
    pipe.close()
    after = _level(roots)
    for node in _NODES:
        assert not os.path.exists(os.path.join(roots[node], name)), node
        assert after[node] <= before[node] + 16, (node, before, after)


_DRIVER = textwrap.dedent("""
    import sys, time
    import ray
    sys.path.insert(0, {repo!r})
    from tests.integration.test_cache_nodes import _pipeline
    ray.init(address={address!r}, log_to_driver=False)
    pipe = _pipeline({folder!r}, {name!r})
    rows = sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=0))
    print("ready", rows, flush=True)
    time.sleep(600)
""")


def _start_driver(cluster, roots, folder, name: str) -> subprocess.Popen:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, decoded_dirs.DECODED_CACHE_DIR_ENV: roots["head"]}
    code = _DRIVER.format(repo=repo, address=cluster.address, folder=str(folder), name=name)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    assert line.startswith("ready 96"), line
    return proc


def _dirs(roots: dict[str, str], name: str) -> dict[str, bool]:
    """Whether each node holds a decoded-cache directory of pipeline ``name`` (its name and
    the pipeline's own suffix)."""
    return {node: bool(glob.glob(os.path.join(root, f"{name}-" + "[0-9a-f]" * 8)))
            for node, root in roots.items()}


@pytest.mark.parametrize("cached", [True, False])
def test_a_new_pipeline_sweeps_a_killed_drivers_pixels_on_every_node(nodes, cached):
    # A pipeline without a decoded cache of its own sweeps too ("auto" is off for most jobs).
    cluster, roots, folder = nodes
    dead, live = (f"nodes-{k}-{uuid.uuid4().hex[:6]}" for k in ("dead", "live"))
    victim = _start_driver(cluster, roots, folder, dead)
    survivor = _start_driver(cluster, roots, folder, live)
    try:
        left = _dirs(roots, dead)
        assert sum(left.values()) >= 2, left  # the victim cached on several nodes
        kept = _dirs(roots, live)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert _dirs(roots, dead) == left, "nothing is removed before a pipeline starts"
        pipe = _pipeline(folder, f"nodes-next-{uuid.uuid4().hex[:6]}", cached=cached)
        try:
            pipe.start()  # the start sweeps every node
            deadline = time.monotonic() + 30
            while any(_dirs(roots, dead).values()) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not any(_dirs(roots, dead).values()), _dirs(roots, dead)
            assert _dirs(roots, live) == kept, "a live driver's pixels stay"
        finally:
            pipe.close()
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
