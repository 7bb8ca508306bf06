"""`raying advise` on three contrasting datasets: different advice, each with its reason.

1. a small local folder (page cache): defaults;
2. a large Parquet set on a disk-like slow tier (large: the machine is told it has 1 MiB of
   memory to spare): cache on disk, 2 reads in flight;
3. many tiny files on S3 (moto, with S3-like latency added): pack, many reads in flight.
No Ray is started.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raying.tools import cli
from raying.tools.advise import advise, format_report
from raying.tools.datagen import encode, make_image_folder, synth_image


@pytest.fixture(scope="module")
def parquet_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(0)
    for k in range(3):
        n = 256
        images = [encode(synth_image(rng, i % 5, 5, 96, 96), "jpg") for i in range(n)]
        table = pa.table({"id": pa.array(np.arange(k * n, (k + 1) * n)),
                          "label": pa.array(np.arange(n) % 5),
                          "image": pa.array(images, pa.binary()),
                          "path": pa.array([f"{i}.jpg" for i in range(n)])})
        pq.write_table(table, root / f"part-{k:05d}.parquet", row_group_size=64,
                       compression="none")
    return root


@pytest.fixture(scope="module")
def tiny_s3(s3_server, s3_endpoint, tmp_path_factory):
    src = make_image_folder(tmp_path_factory.mktemp("tiny"), n=200, classes=4, size=(24, 24),
                            seed=3)
    return s3_server.upload_folder(src, "raying-advise", "tiny")


def _by_setting(report):
    return {a["setting"]: a for a in report["advice"]}


def test_three_datasets_get_different_advice_with_reasons(image_folder, parquet_set, tiny_s3,
                                                          s3_endpoint):
    local = advise(str(image_folder))
    slow_pq = advise(str(parquet_set), {"slow": "hdd"},
                     machine={"memory_available_bytes": 2**20})
    s3 = advise(tiny_s3, {"endpoint_url": s3_endpoint, "slow": (0.03, 100e6)})
    a, b, c = _by_setting(local), _by_setting(slow_pq), _by_setting(s3)
    for report in (a, b, c):
        assert set(report) == {"pack", "pre_decode", "cache", "read_concurrency",
                               "prefetch_batches", "block_rows", "window"}
        assert all(x["reason"] and x["measured"] for x in report.values())

    # 1. small local folder: the defaults.
    assert a["pack"]["value"] == "no" and a["cache"]["value"] == "none"
    assert a["read_concurrency"]["value"] == 1
    assert "page cache" in a["cache"]["reason"]
    # 2. large Parquet on a disk-like tier: already packed, a disk tier, 2 reads in flight.
    assert b["pack"]["value"] == "already Parquet"
    assert "disk" in b["cache"]["value"] and "exceeds the memory tier" in b["cache"]["reason"]
    assert b["read_concurrency"]["value"] == 2
    assert "one request at a time" in b["read_concurrency"]["reason"]
    assert slow_pq["measured"]["storage"]["latency_s"] > 0.005
    assert b["block_rows"]["value"] >= 64  # at least one row group
    # 3. tiny files on S3: pack them, many reads in flight, a memory tier.
    assert c["pack"]["value"].startswith("yes")
    assert "first byte" in c["pack"]["reason"]
    assert c["read_concurrency"]["value"] >= 32
    assert c["cache"]["value"].startswith("memory") and "disk" not in c["cache"]["value"]
    assert c["prefetch_batches"]["value"] > a["prefetch_batches"]["value"]
    assert len({a["pack"]["value"], b["pack"]["value"], c["pack"]["value"]}) == 3
    assert len({a["read_concurrency"]["value"], b["read_concurrency"]["value"],
                c["read_concurrency"]["value"]}) == 3
    text = format_report(s3)
    assert "recommended:" in text and "because" in text and "PipelineConfig(" in text


def test_cli_advise_json(image_folder, capsys):
    assert cli.main(["advise", str(image_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"]["dataset"]["samples"] == 60
    assert report["measured"]["machine"]["cores"] >= 1
    assert {a["setting"] for a in report["advice"]} >= {"pack", "cache", "read_concurrency"}
    assert report["config"]["io"]["concurrency"] == 1
