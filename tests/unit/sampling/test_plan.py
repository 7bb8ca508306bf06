"""Epoch plans: row-group units read every row group once; chunk units keep the order."""

from __future__ import annotations

import numpy as np

from raying.sampling.plan import chunk_units, row_group_units, row_groups_of


def _row_groups():
    # 3 files; row groups of uneven sizes, ids dense in file order
    rows = np.array([5, 3, 4, 4, 1, 6, 2])
    files = np.array([0, 0, 0, 1, 1, 2, 2])
    index = np.array([0, 1, 2, 0, 1, 0, 1])
    start = np.concatenate([[0], np.cumsum(rows)[:-1]])
    return files, index, start, rows


def test_row_group_units_read_each_group_once_and_deliver_every_id_once():
    files, index, start, rows = _row_groups()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(start))
    units = row_group_units(3, files, index, start, rows, order, 2, rng)
    assert [u.index for u in units] == list(range(4)) and all(u.epoch == 3 for u in units)
    groups = np.concatenate([u.row_groups for u in units])
    assert sorted(map(tuple, groups.tolist())) == sorted(
        zip(files.tolist(), index.tolist(), start.tolist(), strict=True))
    ids = np.concatenate([u.ids for u in units])
    assert sorted(ids.tolist()) == list(range(int(rows.sum())))
    for u in units:  # a unit's ids all live in its own row groups
        assert set(row_groups_of(u.ids, files, index, start)[:, 2]) == set(u.row_groups[:, 2])
        assert u.num_rows == len(u.ids) == u.draw


def test_row_group_units_without_an_rng_keep_the_row_order():
    files, index, start, rows = _row_groups()
    units = row_group_units(0, files, index, start, rows, np.arange(len(start)), 3, None)
    assert np.concatenate([u.ids for u in units]).tolist() == list(range(int(rows.sum())))


def test_chunk_units_cut_in_order():
    ids = np.array([9, 3, 4, 1, 0, 2, 8], dtype=np.int64)
    units = chunk_units(1, ids, 3)
    assert [u.ids.tolist() for u in units] == [[9, 3, 4], [1, 0, 2], [8]]
    assert [u.num_rows for u in units] == [3, 3, 1]


def test_row_groups_of_names_the_groups_holding_the_ids():
    files, index, start, _ = _row_groups()
    got = row_groups_of(np.array([0, 4, 5, 21, 20, 24]), files, index, start)
    assert got.tolist() == [[0, 0, 0], [0, 1, 5], [2, 0, 17], [2, 1, 23]]


def test_occurrence_ranks_count_earlier_equal_ids():
    from raying.sampling.plan import occurrence_ranks

    ids = np.array([5, 3, 5, 5, 9, 3, 0], dtype=np.int64)
    assert occurrence_ranks(ids).tolist() == [0, 0, 1, 2, 0, 1, 0]
    assert occurrence_ranks(np.zeros(0, np.int64)).tolist() == []


def test_draw_keys_leave_first_draws_alone_and_tell_repeats_apart():
    from raying.image.rng import draw_keys, uniforms

    ids = np.array([4, 4, 4, 7], dtype=np.int64)
    assert draw_keys(ids, None) is not None and (draw_keys(ids, None) == ids).all()
    assert (draw_keys(ids, np.zeros(4, np.int64)) == ids).all()
    keys = draw_keys(ids, np.array([0, 1, 2, 0]))
    assert keys[0] == 4 and keys[3] == 7 and len(set(keys.tolist())) == 4
    u = uniforms(0, 0, keys, 3)
    assert len({tuple(r) for r in u[:3].tolist()}) == 3  # three draws of id 4, three crops
    np.testing.assert_array_equal(u[0], uniforms(0, 0, ids[:1], 3)[0])


def test_a_row_cap_deals_each_window_into_parts_and_keeps_its_mixing():
    files, index, start, rows = _row_groups()
    order = np.random.default_rng(1).permutation(len(start))
    units = row_group_units(0, files, index, start, rows, order, 4, np.random.default_rng(1),
                            max_rows=4)
    assert all(u.num_rows <= 4 for u in units)
    assert [u.index for u in units] == list(range(len(units)))
    ids = np.concatenate([u.ids for u in units])
    assert sorted(ids.tolist()) == list(range(int(rows.sum())))  # every id once
    for u in units:  # each unit reads exactly the groups holding its ids
        assert sorted(map(tuple, row_groups_of(u.ids, files, index, start).tolist())) == \
            sorted(map(tuple, u.row_groups.tolist()))
    # The windows are those of the uncapped plan, draw for draw: the parts of a window are
    # its shuffled rows, dealt in order (which rows mix is unchanged; the user's
    # window_row_groups holds).
    whole = row_group_units(0, files, index, start, rows, order, 4, np.random.default_rng(1))
    assert ids.tolist() == np.concatenate([u.ids for u in whole]).tolist()
    # Without a cap (or one that does not bind) the plan is the windowed one, unit for unit.
    b = row_group_units(0, files, index, start, rows, order, 4, np.random.default_rng(1),
                        max_rows=100)
    assert [u.ids.tolist() for u in whole] == [u.ids.tolist() for u in b]
    assert [u.row_groups.tolist() for u in whole] == [u.row_groups.tolist() for u in b]


def test_one_large_group_becomes_about_eight_units_for_a_small_epoch():
    """pyarrow and pandas write a file as one row group: one unit would be one read task (one
    core) and one Train share with every row."""
    from raying.sampling.plan import unit_rows_cap

    rows = np.array([2000])
    zero = np.zeros(1, dtype=np.int64)
    units = row_group_units(0, zero, zero, zero, rows, np.arange(1), 4,
                            np.random.default_rng(0), max_rows=unit_rows_cap(2000, 256))
    assert [u.num_rows for u in units] == [250] * 8
    assert unit_rows_cap(2000, 512) == 512 and unit_rows_cap(10**6, 256) == 125_000


def test_the_parts_of_a_large_group_are_fresh_random_rows_each_epoch():
    """Fixed runs kept the same 375 rows together (in batches, in one Train share) every
    epoch, and a file sorted by label gave batches of ~2 classes."""
    from raying.sampling.plan import unit_rows_cap

    n = 3000
    zero = np.zeros(1, dtype=np.int64)
    cap = unit_rows_cap(n, 256)
    parts = []
    for epoch in range(2):
        rng = np.random.default_rng([7, epoch])
        units = row_group_units(epoch, zero, zero, zero, np.array([n]), np.arange(1), 4, rng,
                                max_rows=cap)
        assert sorted(np.concatenate([u.ids for u in units]).tolist()) == list(range(n))
        parts.append([set(u.ids.tolist()) for u in units])
        # Each part is spread over the whole group: its ids span it, not one run of it.
        for u in units:
            assert u.ids.min() < n // 10 and u.ids.max() > n - n // 10
    # Another epoch, other parts: no part of epoch 1 shares more than ~1/8 + noise of its
    # rows with any part of epoch 0 (a fixed cut shared all of them).
    overlap = max(len(a & b) / len(a) for a in parts[1] for b in parts[0])
    assert overlap < 0.25, overlap
    # Without an rng (shuffle=False) the parts are runs in row order.
    units = row_group_units(0, zero, zero, zero, np.array([n]), np.arange(1), 4, None,
                            max_rows=cap)
    assert np.concatenate([u.ids for u in units]).tolist() == list(range(n))


def test_parts_are_whole_blocks_but_the_last():
    """A part of 375 rows is read as blocks of 256 and 119 (a batch of 64 then straddles
    them and is copied); parts of whole blocks keep batches views and a stage's calls full."""
    from raying.sampling.plan import unit_rows_cap

    zero = np.zeros(1, dtype=np.int64)
    for n, block in ((3000, 256), (20, 8), (2049, 64), (96, 8), (2100, 256), (520, 64)):
        cap = unit_rows_cap(n, block)
        units = row_group_units(0, zero, zero, zero, np.array([n]), np.arange(1), 4,
                                np.random.default_rng(0), max_rows=cap, block_rows=block)
        sizes = [u.num_rows for u in units]
        assert sum(sizes) == n and all(s % block == 0 for s in sizes[:-1]), sizes
        # As many parts as the cap asks for (whole blocks permitting), none over a block
        # beyond it: rounded up to whole blocks, 2,100 rows in blocks of 256 made 5 parts
        # [512 x 4, 52] and left 3 of 8 Train shares empty.
        assert len(units) == min(-(-n // cap), -(-n // block)), sizes
        assert max(sizes) <= cap + block, sizes
