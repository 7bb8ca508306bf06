"""The bench reads a workload's files through the page cache before every cell."""

from __future__ import annotations

from raying.bench.workloads import read_through


def test_read_through_reads_every_file_under_the_root(tmp_path):
    sizes = {"a/x.jpg": 10, "a/y.jpg": (1 << 22) + 3, "b/z.parquet": 0, "top.bin": 7}
    for rel, n in sizes.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(range(256)) * (n // 256) + bytes(n % 256))
    assert read_through(str(tmp_path)) == sum(sizes.values())
    assert read_through(str(tmp_path / "a")) == sizes["a/x.jpg"] + sizes["a/y.jpg"]
