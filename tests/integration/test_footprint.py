"""Memory on data larger than the decoded cache: flat from epoch to epoch, counted whole."""

from __future__ import annotations

import os
import threading

import pytest

import raying
from raying.bench.measure import descendants
from raying.read.memory import Footprint
from raying.tools.datagen import make_image_folder

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"),
                                reason="needs Linux /proc smaps_rollup")


class _Peak:
    """The whole footprint of this process's tree (Ray's local node included), sampled."""

    def __init__(self, foot: Footprint) -> None:
        self.foot, self.peak, self._stop = foot, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()

    def _sample(self) -> None:
        self.peak = max(self.peak, self.foot.sample(descendants(os.getpid()))["whole_mb"])

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # an epoch shorter than the interval still gets a reading


def test_five_epochs_on_data_four_times_the_cache_stay_flat(tmp_path, ray_local):
    n, (h, w) = 480, (96, 128)
    root = make_image_folder(tmp_path / "imgs", n=n, classes=4, size=(h, w), seed=3)
    budget = n * h * w * 3 // 4  # the decoded data is 4x what the cache may hold
    m = raying.Manifest.scan(str(root))
    foot = Footprint()
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=64),
                           config=raying.PipelineConfig(block_rows=32, decoded_cache=budget,
                                                        decoded_cache_fill=None))
    peaks, whole = [], []
    for epoch in range(5):
        with _Peak(foot) as peak:
            rows = sum(len(b["id"]) for b in pipe.iter_batches(batch_size=32, epoch=epoch))
        assert rows == n
        peaks.append(peak.peak)
        whole.append(pipe.stats()["memory"])
    # The cache's entries never exceed its budget (LRU evicts); its directory also holds
    # entries rounded up to 4 KiB pages (~10 % on these 37 KB images) and the SQLite index with
    # its write-ahead log, which SQLite's auto-checkpoint bounds at ~1,000 pages (4 MB).
    for mem in whole:
        assert mem["decoded_cache_mb"] <= budget / 2**20 * 1.15 + 4.5, mem
    assert peaks[4] <= peaks[1] * 1.10, peaks
    assert whole[4]["whole_mb"] <= whole[1]["whole_mb"] * 1.10, whole
    io = pipe.stats()["io"]
    assert 0 < io["decoded_cache_hit_ratio"] < 0.6, io  # it thrashes, as it must at 1/4
    pipe.close()
