"""Memory counted whole: own pages per process plus tmpfs growth, each page once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from raying.read import memory

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                                reason="needs Linux /proc smaps_rollup")


def test_own_memory_grows_with_what_the_process_touches():
    before = memory.own_kib()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
    after = memory.own_kib()
    assert after - before >= 60 * 1024, (before, after)
    del block


def test_a_gone_process_reads_as_zero():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert memory.process_kib(int(proc.stdout)) == {"anon": 0, "file": 0, "shmem": 0}


@pytest.mark.skipif(not os.path.isdir(memory.DEFAULT_TMPFS), reason="no /dev/shm")
def test_tmpfs_pages_count_once_whether_mapped_or_not():
    foot = memory.Footprint()
    path = os.path.join(memory.DEFAULT_TMPFS, f"raying-test-{uuid.uuid4().hex}")
    try:
        with open(path, "wb") as fh:
            fh.write(b"\x01" * (32 << 20))
        grown = foot.sample([])["tmpfs_mb"]
        assert 31 <= grown <= 48, grown  # other tenants of /dev/shm may add a little
        # Mapped and read by this process: its pages are Pss_Shmem, outside own memory, so
        # the whole figure does not count them a second time.
        own0 = memory.own_kib()
        arr = np.memmap(path, dtype=np.uint8, mode="r")
        assert int(arr[:: 4096].sum()) == (32 << 20) // 4096
        assert memory.process_kib()["shmem"] >= 30 * 1024
        assert memory.own_kib() - own0 < 8 * 1024
        whole = foot.sample([os.getpid()])
        assert whole["whole_mb"] == pytest.approx(whole["own_mb"] + whole["tmpfs_mb"])
        del arr
    finally:
        os.unlink(path)
    assert foot.sample([])["tmpfs_mb"] < 16


def test_dir_bytes_counts_files_below(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"0" * 10_000)
    (tmp_path / "y").write_bytes(b"0" * 5_000)
    assert memory.dir_bytes(str(tmp_path)) >= 15_000
    assert memory.dir_bytes(str(tmp_path / "gone")) == 0


_WORKER = r"""
import json, pickle, sys
with open(sys.argv[1], "rb") as fh:
    task, spec, unit, paths = pickle.load(fh)   # what a Ray read worker unpickles
rows, frameworks = 0, ()
for block, account in task(spec, unit, paths, 8):
    rows += len(block["id"])
    frameworks = account.frameworks or frameworks
heavy = ("raying.loader.pipeline", "raying.dataset.manifest", "raying.sampling.prioritized",
         "ray.data")
print(json.dumps({"rows": rows, "frameworks": list(frameworks),
                  "loaded": [m for m in (*memory_names, *heavy) if m in sys.modules]}))
"""


def test_a_read_task_imports_no_framework_and_none_of_the_driver_side(tmp_path):
    """A read worker runs the task after unpickling it: it must not pay for torch, tf,
    pandas or matplotlib, nor for the manifest scanner, the pipeline or Ray Data."""
    import pickle

    import raying
    from raying.engine.stream import read_task
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "imgs", n=12, classes=2, size=(40, 30), seed=0)
    pipe = raying.Pipeline(raying.Manifest.scan(str(root)),
                           transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache="off"))
    unit, paths = pipe._fill(pipe.plan(0).units[0])
    job = tmp_path / "task.pkl"
    job.write_bytes(pickle.dumps((read_task, pipe._spec, unit, paths)))
    code = f"memory_names = {memory.FRAMEWORKS!r}\n" + _WORKER
    proc = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True,
                          text=True, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rows"] == len(unit.ids) > 0, got
    assert got == {"rows": got["rows"], "frameworks": [], "loaded": []}, got


def test_loaded_frameworks_names_what_this_process_imported():
    import sys as _sys

    assert "numpy" not in memory.FRAMEWORKS
    assert set(memory.loaded_frameworks()) == {n for n in memory.FRAMEWORKS if n in _sys.modules}


def test_a_read_workers_memory_is_read_at_most_once_a_second_unless_a_framework_loads(
        monkeypatch):
    """Each unit's account carries its worker's memory; /proc is read afresh only when the
    last reading is a second old or a framework was imported since."""
    import raying.read.task as task

    readings: list[int] = []
    loaded = [("numpy",)]
    clock = [100.0]

    def own_kib():
        readings.append(1)
        return 1000 * len(readings)

    monkeypatch.setattr(task._memory, "own_kib", own_kib)
    monkeypatch.setattr(task._memory, "loaded_frameworks", lambda: loaded[0])
    monkeypatch.setattr(task.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(task, "_worker_memory", [None, 0.0, ()])
    assert task._worker_kib() == 1000
    clock[0] += 0.5
    assert task._worker_kib() == 1000 and len(readings) == 1  # half a second: the same
    loaded[0] = ("numpy", "torch")
    assert task._worker_kib() == 2000  # torch imported: read again at once
    clock[0] += task.WORKER_MEMORY_EVERY_S
    assert task._worker_kib() == 3000 and len(readings) == 3


def test_a_read_s_footer_is_freed_as_soon_as_it_is_dropped(tmp_path):
    """Read tasks parse a file's footer per unit to check its row groups against the scan;
    touching ``FileMetaData.schema`` ties footer and schema in a reference cycle, so every
    footer lived until the cyclic collector ran (~1 GB per read worker with 2 MB footers)."""
    import gc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raying.dataset.scan import image_leaves

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"label": list(range(10)), "image": [b"x"] * 10}), path,
                   row_group_size=2)
    gc.collect()
    gc.disable()
    try:
        md = pq.read_metadata(path)
        assert image_leaves(md, "image") == [1]
        del md
        assert gc.collect() == 0  # nothing was left for the cycle collector
        md = pq.read_metadata(path)
        assert md.schema is not None  # what the check did before: a cycle (the test fails
        del md                        # without gc if pyarrow ever drops it)
        assert gc.collect() > 0
    finally:
        gc.enable()
