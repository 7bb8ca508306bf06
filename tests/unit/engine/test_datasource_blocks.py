"""The Arrow blocks ``pipe.dataset(e)``'s read tasks hand Ray Data (no cluster needed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raying
from raying.engine.datasource import _arrow_lists, empty_arrow_block
from raying.read.task import iter_unit
from tests.unit.read.test_stages import write_parquet_set

SIZE = 16


def first_block(pipe):
    from ray.data.block import BlockAccessor

    unit, paths = pipe._fill(pipe.plan(0).units[0])
    block, _ = next(iter(iter_unit(pipe._spec, unit, paths, block_rows=8)))
    assert len(block["id"])
    return BlockAccessor.batch_to_block(_arrow_lists(block, pipe._spec.columns))


def with_fixed_width_and_bytes(root):
    """A Parquet file with a fixed-width float array and a binary column beside the image."""
    from raying.tools.datagen import encode, synth_image

    rng = np.random.default_rng(1)
    pq.write_table(pa.table({
        "image": pa.array([encode(synth_image(rng, i % 2, 2, 24, 32), "jpg") for i in range(12)],
                          pa.binary()),
        "label": pa.array([i % 2 for i in range(12)], pa.int64()),
        "emb": pa.array([[float(i)] * 4 for i in range(12)], pa.list_(pa.float32(), 4)),
        "raw": pa.array([bytes([i]) * 3 for i in range(12)], pa.binary()),
    }), f"{root}/part-0.parquet", row_group_size=6)
    return root


@pytest.mark.parametrize("kind", ["folder", "columns", "fixed_width_and_bytes"])
def test_an_empty_block_has_the_arrow_types_of_blocks_with_rows(tmp_path, kind):
    """A read task whose every row was set aside yields a block of no rows: Ray Data would
    make its image column (and fixed-width or string columns) pickled Python objects, unlike
    every other block's, and log a conversion warning."""
    if kind == "folder":
        from raying.tools.datagen import make_image_folder

        m = raying.Manifest.scan(make_image_folder(tmp_path, n=12, classes=2, size=(24, 20),
                                                   seed=3, formats=("jpg",)))
    elif kind == "columns":
        m = raying.Manifest.scan(str(write_parquet_set(tmp_path)),
                                 columns=["caption", "n", "boxes"])
    else:
        m = raying.Manifest.scan(str(with_fixed_width_and_bytes(tmp_path)),
                                 columns=["emb", "raw"])
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=SIZE))
    real = first_block(pipe)
    empty = empty_arrow_block(SIZE, pipe._spec.columns)
    assert empty.num_rows == 0
    assert empty.schema.equals(real.schema, check_metadata=True), (empty.schema, real.schema)


def test_skips_of_both_paths_are_listed_once_at_their_first_epoch_and_counted():
    """stats(): a sample set aside by pipe.dataset(1) and again by the iterator's epoch 2 is
    listed once, with epoch 1, and the dataset path's skip events and retries count in the top
    level."""
    from raying.engine.datasource import merge_dataset_account

    def skip(i, epoch, reason="truncated"):
        return {"id": i, "path": f"f{i}.jpg", "reason": reason, "detail": "", "epoch": epoch}

    out = {"skipped": [skip(1, 2), skip(2, 2, "not_an_image")], "skipped_count": 2,
           "skipped_by_reason": {"truncated": 1, "not_an_image": 1}, "skip_events": 2,
           "read_retries": 4}
    reads = {"skipped": [skip(1, 1), skip(2, 3, "not_an_image"), skip(3, 1, "not_an_image")],
             "skip_events": 3, "rows_read": 10, "rows_delivered": 0, "stall_s": 0.0,
             "read_retries": 6}
    merge_dataset_account(out, reads)
    assert [(s["id"], s["epoch"]) for s in out["skipped"]] == [(1, 1), (2, 2), (3, 1)]
    assert out["skipped_count"] == 3 and out["skip_events"] == 5
    assert out["read_retries"] == 10 and out["dataset"]["read_retries"] == 6
    assert out["skipped_by_reason"] == {"truncated": 1, "not_an_image": 2}
    assert out["dataset"]["rows_read"] == 10
    # What Ray Data's iterators delivered is not the read tasks' to say: not shown as 0.
    assert "rows_delivered" not in out["dataset"] and "stall_s" not in out["dataset"]


def test_text_and_bytes_mixed_in_one_column_is_told_apart_from_numpy_text():
    from raying.engine.datasource import _text_and_bytes

    def column(*values):
        out = np.empty(len(values), object)
        out[:] = list(values)
        return out

    assert _text_and_bytes(column("a", b"b"))
    assert _text_and_bytes(column(np.str_("a"), np.bytes_(b"b")))
    # str beside numpy's str (a column filled partly from a numpy string array) is all text.
    assert not _text_and_bytes(column("a", np.array(["b"])[0]))
    assert not _text_and_bytes(column(b"a", np.array([b"b"])[0], None))


def test_the_accounts_actor_class_is_made_once_per_process():
    # Each @ray.remote class is a type Ray registers: one per dataset grew the driver.
    from raying.engine.datasource import _account_actor_cls

    assert _account_actor_cls() is _account_actor_cls()
