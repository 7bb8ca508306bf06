"""BatchAssembler cuts blocks into batches; the resume position finds the next row."""

from __future__ import annotations

import numpy as np
import pytest

from raying.errors import ConfigError
from raying.loader.batches import BatchAssembler
from raying.loader.pipeline import _position


def _block(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"id": ids, "image": np.zeros((n, 2, 2, 3), np.uint8) + (ids % 251)[:, None, None,
                                                                                None].astype(np.uint8)}


@pytest.mark.parametrize("sizes", [[10, 10, 10], [3, 17, 1, 9], [64], [0, 5, 0, 7]])
@pytest.mark.parametrize("batch_size", [1, 4, 10, 64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_keep_every_row_in_order(sizes, batch_size, drop_last):
    asm = BatchAssembler(batch_size, drop_last=drop_last)
    batches, start = [], 0
    for n in sizes:
        batches.extend(asm.push(_block(start, n)))
        start += n
    batches.extend(asm.finish())
    total = sum(sizes)
    kept = total - total % batch_size if drop_last else total
    ids = np.concatenate([b["id"] for b in batches]) if batches else np.zeros(0, np.int64)
    assert ids.tolist() == list(range(kept))
    assert all(len(b["id"]) == batch_size for b in batches[:-1])
    assert not batches or 0 < len(batches[-1]["id"]) <= batch_size
    for b in batches:  # columns stay aligned row by row
        assert np.array_equal(b["image"][:, 0, 0, 0], (b["id"] % 251).astype(np.uint8))


def test_an_epoch_drop_last_empties_says_so():
    asm = BatchAssembler(64, drop_last=True)
    with pytest.warns(UserWarning, match=r"dropped every row of this epoch: its 50 rows.*"
                                         r"batch_size=64"):
        assert list(asm.push(_block(0, 50))) + list(asm.finish()) == []
    # An epoch that gave a batch before its short remainder says nothing.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(asm.push(_block(0, 70))) + list(asm.finish())) == 1


def test_a_batch_inside_one_block_is_a_view_not_a_copy():
    block = _block(0, 8)
    (first, second) = list(BatchAssembler(4).push(block))
    assert np.shares_memory(first["image"], block["image"])
    assert np.shares_memory(second["id"], block["id"])


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="batch_size must be a positive int"):
        BatchAssembler(bad)


def test_resume_position_counts_rows_across_units_and_blocks():
    # unit 0 came as two blocks (rows 0-4, 4-6, last), unit 1 as one block of 5, not last
    units = [(0, 0, 4, False), (0, 4, 6, True), (1, 0, 5, False)]
    assert _position(units, 0) == (0, 0)
    assert _position(units, 3) == (0, 3)
    assert _position(units, 4) == (0, 4)
    assert _position(units, 6) == (1, 0)
    assert _position(units, 10) == (1, 4)
    assert _position(units, 11) == (1, 5)  # unit 1 goes on: its next block starts at row 5
    assert _position(units[:2], 6) == (1, 0)  # unit 0 finished: the next unit, from its start
    assert _position([], 0, start=(3, 7)) == (3, 7)  # nothing yet since a resume at (3, 7)


def test_an_empty_block_without_the_stages_columns_joins_no_batch():
    """A block whose every sample was bad carries no rows and none of the columns user stages
    add (they run on rows only): the batch that straddles it keeps those columns."""
    def staged(start, n):
        return {**_block(start, n), "extra": np.arange(start, start + n) * 2.0}

    asm = BatchAssembler(8)
    batches = [*asm.push(staged(0, 5)), *asm.push(_block(5, 0)), *asm.push(staged(5, 5)),
               *asm.finish()]
    assert [len(b["id"]) for b in batches] == [8, 2]
    for b in batches:
        assert (b["extra"] == b["id"] * 2.0).all()


def test_blocks_with_other_columns_than_the_first_stop_the_epoch(tmp_path):
    import raying
    from raying.errors import UserFunctionError
    from raying.tools.datagen import make_image_folder

    def sometimes(batch):
        return batch

    root = make_image_folder(tmp_path / "img", n=4, classes=1, size=(8, 8))
    pipe = raying.Pipeline(raying.Manifest.scan(str(root)),
                           transform=raying.ImageTransform(size=4)).map_batches(sometimes)
    keys = pipe._same_columns(None, _block(0, 3), 1)
    assert pipe._same_columns(keys, _block(3, 2), 1) == keys
    with pytest.raises(UserFunctionError, match=r"map_batches function .*sometimes returned "
                                                r"columns \['extra', 'id', 'image'\] for some "
                                                r"blocks and \['id', 'image'\] for others.* "
                                                r"\(epoch 1, ids \[5, 6\]\)"):
        pipe._same_columns(keys, {**_block(5, 2), "extra": np.zeros(2)}, 1)
    pipe.close()


def test_torch_gets_numpy_strings_as_lists_and_a_clear_error_for_datetimes():
    pytest.importorskip("torch")
    from raying.loader.batches import TorchConverter

    conv = TorchConverter("cpu", normalize=False)
    out = conv.host({"id": np.arange(2), "name": np.array(["a", "bc"]),
                     "raw": np.array([b"x", b"yz"])})
    assert out["name"] == ["a", "bc"] and out["raw"] == [b"x", b"yz"]
    with pytest.raises(ConfigError, match=r"column 'when' holds datetime64\[s\], which torch "
                                          r"has no tensor type for"):
        conv.host({"id": np.arange(2), "when": np.array(["2026-01-01", "2026-01-02"],
                                                         dtype="datetime64[s]")})


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"batch_size": 0}, r"batch_size must be a positive int, got 0"),
    ({"prefetch_batches": -1}, r"prefetch_batches must be an int >= 0 .* got -1"),
    ({"prefetch_batches": 1.5}, r"prefetch_batches must be an int >= 0 .* got 1.5"),
    ({"drop_last": "no"}, r"drop_last must be True or False, got 'no'"),
])
def test_bad_iteration_arguments_fail_before_the_reads_start(tmp_path, kwargs, pattern):
    import raying
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=4, classes=1, size=(8, 8))
    pipe = raying.Pipeline(raying.Manifest.scan(str(root)), transform=raying.ImageTransform(size=4))
    for it in (pipe.iter_batches, pipe.iter_torch_batches):
        with pytest.raises(ConfigError, match=pattern):
            next(it(**kwargs))
    assert pipe._stream is None  # no read stream (nor Ray) was started for them
    pipe.close()


def test_torch_mean_and_std_take_any_three_numbers_and_refuse_empty_ones(tmp_path):
    torch = pytest.importorskip("torch")
    import raying
    from raying.tools.datagen import make_image_folder

    root = make_image_folder(tmp_path / "img", n=4, classes=1, size=(8, 8))
    pipe = raying.Pipeline(raying.Manifest.scan(str(root)), transform=raying.ImageTransform(size=4))
    with pytest.raises(ConfigError, match=r"mean must be 3 finite numbers"):
        next(pipe.iter_torch_batches(mean=(), device="cpu"))
    with pytest.raises(ConfigError, match=r"std must be 3 finite numbers"):
        next(pipe.iter_torch_batches(std=[], device="cpu"))
    from raying.loader.batches import TorchConverter

    # Figures on the 0-255 scale are refused, with the 0-1 ones to pass instead.
    with pytest.raises(ConfigError, match=r"0-255 scale.*\(0\.502, 0\.502, 0\.502\)"):
        TorchConverter("cpu", normalize=True, mean=(128, 128, 128))
    with pytest.raises(ConfigError, match=r"std=.*0-255 scale"):
        TorchConverter("cpu", normalize=True, std=(58.4, 57.1, 57.4))
    for mean, std in ((np.array([0.5, 0.5, 0.5]), torch.tensor([0.25, 0.25, 0.25])),
                      ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))):
        conv = TorchConverter("cpu", normalize=True, mean=mean, std=std)
        x = conv.to_float(torch.full((1, 2, 2, 3), 255, dtype=torch.uint8))
        assert torch.allclose(x, torch.full_like(x, 2.0))  # (1 - 0.5) / 0.25
    pipe.close()


def test_a_consumer_that_stops_early_does_not_wait_for_a_read_in_flight():
    # break (or Ctrl-C) while the prefetch thread waits on a slow read: the consumer goes on
    # at once; the thread ends, and closes the source, when that read returns.
    import threading
    import time

    from raying.loader.batches import PREFETCH_STOP_WAIT_S, prefetch

    release, closed = threading.Event(), threading.Event()

    def source():
        try:
            yield 0
            yield 1
            release.wait(30)  # a read that takes long
            yield 2
            yield 3
        finally:
            closed.set()

    left: list = []
    it = prefetch(source(), 1, left_running=left)
    assert next(it) == 0
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < PREFETCH_STOP_WAIT_S + 1.0
    assert not closed.is_set()  # still in the read
    # The thread is handed over, for whoever shuts the source's resources down to wait for.
    assert len(left) == 1 and left[0].is_alive()
    release.set()
    assert closed.wait(5), "the source was not closed once its read returned"
    left[0].join(5)
    assert not left[0].is_alive()
    # A consumer that stops while the thread is quick closes the source before it returns.
    quick, done = threading.Event(), []

    def fast():
        try:
            yield from range(100)
        finally:
            done.append(True)
            quick.set()

    it = prefetch(fast(), 2)
    assert next(it) == 0
    it.close()
    assert quick.wait(5) and done == [True]


def test_a_consumer_stops_waiting_on_a_read_that_never_returns_once_told_it_ended():
    # A read waiting inside Ray when the training thread shuts Ray down may never return
    # (Ray's wait on the old session blocks for good): the consumer asks ``ended`` while it
    # waits and raises its error instead of hanging with the thread.
    import threading
    import time

    from raying.loader.batches import PREFETCH_POLL_S, prefetch

    never, gone = threading.Event(), threading.Event()

    def source():
        yield 0
        never.wait(60)  # blocked for good
        yield 1

    asked: list[float] = []

    def ended():
        asked.append(time.perf_counter())
        return ConfigError("the session ended") if gone.is_set() else None

    left: list = []
    it = prefetch(source(), 2, left_running=left, ended=ended)
    assert next(it) == 0
    threading.Timer(1.2, gone.set).start()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="the session ended"):
        next(it)
    waited = time.perf_counter() - t0
    assert 1.2 <= waited < 1.2 + PREFETCH_POLL_S + 2.0, waited
    assert len(asked) >= 2  # asked while Ray was still up, and answered None
    assert len(left) == 1 and left[0].is_alive()  # handed over, still blocked
    never.set()
    left[0].join(5)
    # Without ``ended`` a quick source is unchanged: every item, in order.
    assert list(prefetch(iter(range(50)), 3, ended=lambda: None)) == list(range(50))


def test_a_device_torch_cannot_use_is_a_config_error_naming_the_fix():
    import torch

    from raying.loader.batches import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="is not a torch device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sees no CUDA device.*device='auto'"):
            resolve_device("cuda")


def _big_block(start: int, n: int, side: int = 128) -> dict[str, np.ndarray]:
    """A block whose images are large enough (49 KB a row) for straddling batches to be
    joined into reused arrays."""
    ids = np.arange(start, start + n, dtype=np.int64)
    image = np.empty((n, side, side, 3), np.uint8)
    image[:] = (ids % 251).astype(np.uint8)[:, None, None, None]
    return {"id": ids, "image": image}


def _check_rows(batch: dict) -> None:
    expected = (batch["id"] % 251).astype(np.uint8)
    assert np.array_equal(batch["image"][:, -1, -1, -1], expected)
    assert np.array_equal(batch["image"][:, 0, 0, 0], expected)


def _straddling_batches(keep: list | None, hold=lambda b: b):
    """30 blocks of 50 rows in batches of 32: most batches straddle two blocks."""
    asm = BatchAssembler(32)
    for k in range(30):
        for batch in asm.push(_big_block(50 * k, 50)):
            yield batch
            if keep is not None:
                keep.append(hold(batch))
    yield from asm.finish()


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_straddling_batches_a_trainer_keeps_are_never_overwritten():
    torch = pytest.importorskip("torch")
    for hold in (lambda b: b, lambda b: b["image"][3:], lambda b: torch.from_numpy(b["image"]),
                 lambda b: memoryview(b["image"])):
        kept: list = []
        ids = []
        for batch in _straddling_batches(kept, hold):
            ids.append(batch["id"])
        assert np.concatenate(ids).tolist() == list(range(1500))
        # Every kept batch (all but the last, from finish()) still holds its own rows.
        for batch_ids, held in zip(ids[:len(kept)], kept, strict=True):
            image = np.asarray(held["image"] if isinstance(held, dict) else held)
            expected = (batch_ids % 251).astype(np.uint8)
            assert np.array_equal(image[:, 0, 0, 0], expected[len(expected) - len(image):])


def test_straddling_batches_a_trainer_drops_reuse_a_few_arrays():
    asm = BatchAssembler(32)
    joined = set()
    for k in range(30):
        block = _big_block(50 * k, 50)
        for batch in asm.push(block):
            _check_rows(batch)
            if not np.shares_memory(batch["image"], block["image"]):
                joined.add(batch["image"].__array_interface__["data"][0])
    # Most batches straddle two blocks (28 of the 46 here); each is dropped once the next
    # is taken, so two joined arrays serve them all (the one held, the one being joined).
    arrays = [a for entries in asm._reuse._arrays.values() for a, _ in entries]
    assert len(arrays) == 2 and len(joined) == 2


def test_joined_columns_of_one_size_but_other_dtypes_keep_their_own():
    # Two structured dtypes of 128 bytes (fields named otherwise; 5 MB a batch, joined into
    # reused arrays): a join must never cast one into an array of the other.
    a = np.dtype([("lo", "<f8", (8,)), ("hi", "<f8", (8,))])
    b = np.dtype([("x", "<f8", (8,)), ("y", "<f8", (8,))])
    asm = BatchAssembler(40000)
    blocks = [{"id": np.arange(k * 30000, (k + 1) * 30000), "a": np.zeros(30000, a),
               "b": np.ones(30000, b)} for k in range(4)]
    kept = []
    for block in blocks:
        for batch in asm.push(block):
            assert batch["a"].dtype == a and batch["b"].dtype == b
            kept.append(batch["a"])
            del batch  # and with it "b": its array is free for the next join
    assert len(kept) == 3 and all(k.dtype == a for k in kept)


def test_the_first_block_holds_whole_batches_or_is_the_whole_unit():
    from raying.engine.stream import DEFAULT_FIRST_BLOCK_ROWS, first_block_rows

    assert first_block_rows(None, 256, aligned=False) == DEFAULT_FIRST_BLOCK_ROWS
    assert first_block_rows(64, 256, aligned=True) == 64
    assert first_block_rows(32, 256, aligned=True) == 64
    assert first_block_rows(48, 256, aligned=True) == 96  # two batches of 48
    assert first_block_rows(100, 256, aligned=False) == 100
    # 100 is not a multiple of the stages' 16-row chunks: the default edge, which is
    assert first_block_rows(100, 256, aligned=True) == DEFAULT_FIRST_BLOCK_ROWS
    assert first_block_rows(128, 256, aligned=True) == 128
    # A first batch of a whole unit waits for the whole unit: no short block.
    assert first_block_rows(256, 256, aligned=True) is None
    assert first_block_rows(512, 256, aligned=False) is None
    assert first_block_rows(64, 40, aligned=False) is None


def test_a_part_keeps_to_its_share_of_the_byte_budget_below_one_block():
    from raying.engine.stream import _part_rows

    row = 224 * 224 * 3  # 150,528 bytes
    mb = 1 << 20
    # Whole blocks where the share holds them: a block, or several.
    assert _part_rows(128 * mb, 3, row, 256, splittable=True) == 256
    assert _part_rows(160 * mb, 2, row, 256, splittable=True) == 512  # 80 MB: 2 blocks
    # A Train worker's shard of a 256 MB store (64 MB over a least window of 2): a block of
    # 38.5 MB is over its 32 MB, but two of them are within twice the budget: whole.
    assert _part_rows(64 * mb, 2, row, 256, splittable=True) == 256
    # 384-px images on 2 cores: three blocks of 113 MB are past twice 128 MB; three halves
    # (170 MB) are within it.
    assert _part_rows(128 * mb, 3, 384 * 384 * 3, 256, splittable=True) == 128
    # Two 38.5 MB blocks past twice 32 MB: halves; past twice 16 MB: quarters.
    assert _part_rows(32 * mb, 2, row, 256, splittable=True) == 128
    assert _part_rows(16 * mb, 2, row, 256, splittable=True) == 64
    # Never under one stage chunk (16 rows), rounded up to whole chunks, never over a block.
    assert _part_rows(1, 2, row, 256, splittable=True) == 16
    assert _part_rows(1, 2, row, 8, splittable=True) == 8
    assert _part_rows(12 * mb, 2, row, 224, splittable=True) == 64  # 56 rows, up to chunks
    # No budget, or units that must not be split: None.
    assert _part_rows(None, 2, row, 256, splittable=True) is None
    assert _part_rows(64 * mb, 2, row, 256, splittable=False) is None


def test_an_epoch_s_last_units_are_sliced_at_whole_batches_and_stage_chunks():
    from raying.engine.stream import TAIL_MIN_ROWS, tail_rows

    assert tail_rows(256, 64) == 64  # four slices of one batch
    assert tail_rows(256, None) == 64
    assert tail_rows(256, 32) == 64  # two batches each
    assert tail_rows(256, 48) == 96  # whole batches of 48 (a multiple of 16)
    assert tail_rows(256, 100) == 64  # 100 is not a multiple of 16: at the stages' chunks
    assert tail_rows(250, None) == 64  # ceil(250 / 4) = 63, up to the chunk
    assert tail_rows(256, 128) == 128  # halves
    # A batch of the whole unit: slices at the chunks, the batch joined from them (a copy)
    # as the cores still finish the epoch together.
    assert tail_rows(256, 256) == 64
    # Whole batches only where they still cut the unit in halves or finer: a batch of 240
    # or 192 would leave slices of 240 + 16 or 192 + 64, which balance nothing.
    assert tail_rows(256, 240) == 64 and tail_rows(256, 192) == 64
    # No slice under TAIL_MIN_ROWS: a small unit is halved, or read whole.
    assert tail_rows(2 * TAIL_MIN_ROWS, None) == TAIL_MIN_ROWS
    assert tail_rows(2 * TAIL_MIN_ROWS - 1, None) is None
    assert tail_rows(TAIL_MIN_ROWS, 16) is None


def test_an_epoch_s_tail_is_sliced_for_the_tasks_that_run_at_once():
    from raying.engine.stream import _task_slots

    assert _task_slots(3, 4, 1.0) == 2  # 2 cores (min_window: one per core, plus one)
    assert _task_slots(17, 32, 4.0) == 4  # 16 cores, tasks of 4 CPUs
    assert _task_slots(17, 32, 0.5) == 32  # half-CPU tasks: two per core
    assert _task_slots(17, 8, 1.0) == 8  # at most the window
    assert _task_slots(2, 2, 1.0) == 1  # one core (a Train worker's share): nothing to balance


@pytest.mark.parametrize("block_read_only", [True, False])
def test_every_batch_is_read_only_whatever_the_batch_size(block_read_only):
    def block_of(start, n):
        block = _big_block(start, n, side=64)
        for v in block.values():
            # As blocks in the object store are; a small block Ray passes inline is not.
            v.flags.writeable = not block_read_only
        return block

    for batch_size in (7, 64, 100):
        asm = BatchAssembler(batch_size)
        batches = [b for k in range(6) for b in asm.push(block_of(50 * k, 50))]
        batches += list(asm.finish())
        for b in batches:
            assert not b["image"].flags.writeable and not b["id"].flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                b["image"][0, 0, 0, 0] = 1
