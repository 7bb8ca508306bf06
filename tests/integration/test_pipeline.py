"""The foundation end to end: folder and Parquet, epochs, seeds, torch and tf batches."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import raying


def _epoch(pipe, epoch, batch_size=16):
    ids, labels = [], []
    for b in pipe.iter_batches(batch_size=batch_size, epoch=epoch):
        ids.append(b["id"])
        labels.append(b["label"])
        assert b["image"].dtype == np.uint8
        assert b["image"].shape[1:] == (32, 32, 3)
    return np.concatenate(ids), np.concatenate(labels)


def _truth(m):
    names = [raying.Manifest.path_of(m, i)[0] for i in range(len(m))]
    return {i: int(n.split("/")[0].split("_")[-1]) for i, n in enumerate(names)}


@pytest.fixture(scope="module")
def packed(image_folder, tmp_path_factory, ray_local):
    dst = tmp_path_factory.mktemp("packed")
    res = raying.pack(str(image_folder), str(dst), shard_rows=25, row_group_rows=8,
                      progress=False)
    assert res.rows == 60 and not res.skipped
    return dst


def test_pack_refuses_a_destination_with_parquet_unless_overwrite(image_folder, packed,
                                                                   tmp_path, ray_local):
    import shutil

    dst = tmp_path / "again"
    shutil.copytree(packed, dst)  # 3 shards of 25 rows
    shutil.move(dst / "part-00002.parquet", dst / "old.pq")  # a scan reads .pq too
    with pytest.raises(raying.ConfigError, match=r"already holds 3 Parquet.*overwrite=True"):
        raying.pack(str(image_folder), str(dst), shard_rows=100, progress=False)
    assert len(list(dst.glob("*.parquet")) + list(dst.glob("*.pq"))) == 3  # nothing deleted
    res = raying.pack(str(image_folder), str(dst), shard_rows=100, progress=False,
                      overwrite=True)
    assert res.shards == ["part-00000.parquet"]
    back = raying.Manifest.scan(str(dst), format="parquet", label="label")
    assert len(back) == 60, "old shards must not be read with the new one"



def test_pack_refuses_a_destination_that_holds_images(image_folder, tmp_path, ray_local):
    """Shards beside image files make a folder no scan can read without being told which
    dataset it is: refused, overwrite or not, naming a file."""
    import shutil

    dst = tmp_path / "mixed"
    (dst / "a").mkdir(parents=True)
    one = sorted(image_folder.rglob("*.jpg"))[0]
    shutil.copy(one, dst / "a" / one.name)
    for overwrite in (False, True):
        with pytest.raises(raying.ConfigError, match=rf"holds 1 image file\(s\) \(a/{one.name}, "
                                                     r"\.\.\.\).*folder of its own"):
            raying.pack(str(image_folder), str(dst), shard_rows=100, progress=False,
                        overwrite=overwrite)
    left = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*"))
    assert left == ["a", f"a/{one.name}"]  # nothing written


def test_pack_refuses_a_destination_that_holds_the_source(image_folder, packed, tmp_path,
                                                          ray_local):
    """A destination above the source: a scan of it would read the source with the shards,
    and overwrite=True deleted a Parquet source before its rows were read."""
    import shutil

    dst = tmp_path / "store"
    src = dst / "train"
    shutil.copytree(packed, src)  # a Parquet dataset inside the destination
    for overwrite in (False, True):
        with pytest.raises(raying.ConfigError, match=r"the source .*train lies inside .*store"):
            raying.pack(str(src), str(dst), shard_rows=100, progress=False,
                        overwrite=overwrite)
    assert len(list(src.glob("*.parquet"))) == 3  # nothing deleted
    one = sorted(src.glob("*.parquet"))[0]  # one file of the destination's own top level
    with pytest.raises(raying.ConfigError, match=r"the source .*part-00000.parquet lies "
                                                 r"inside .*train"):
        raying.pack(str(one), str(src), shard_rows=100, progress=False, overwrite=True)
    assert one.exists()


def test_pack_overwrite_deletes_only_the_top_level_shards(image_folder, packed, tmp_path,
                                                         ray_local):
    """Another dataset in a subfolder of the destination is not deleted by overwrite=True
    (it was, without a word): refused, naming it."""
    import shutil

    dst = tmp_path / "out"
    shutil.copytree(packed, dst)
    shutil.copytree(packed, dst / "other_dataset")
    with pytest.raises(raying.ConfigError, match=r"holds Parquet files in its subfolders "
                                                 r"\(other_dataset/part-0000"):
        raying.pack(str(image_folder), str(dst), shard_rows=100, progress=False,
                    overwrite=True)
    assert len(list(dst.rglob("*.parquet"))) == 6  # nothing deleted


def test_shards_of_a_killed_pack_are_never_scanned_and_go_at_the_next_pack(image_folder,
                                                                           tmp_path,
                                                                           ray_local):
    """A pack killed part-way (SIGKILL, a lost SSH session) leaves only shards under names
    scans skip: its destination never reads as a whole, smaller dataset (a scan found 40 of
    300 samples), and the next pack there removes them."""
    from raying.dataset.pack import PENDING_NAME, SHARD_NAME, pack_shard
    from raying.options import StorageOptions

    dst = tmp_path / "out"
    m = raying.Manifest.scan(str(image_folder))
    for k in range(2):  # what the shard tasks wrote before the driver was killed
        pack_shard(m, np.arange(10 * k, 10 * k + 10), str(dst), StorageOptions(),
                   PENDING_NAME.format(SHARD_NAME.format(k)), decode_size=None,
                   row_group_rows=8, on_error="skip", verify=False)
    assert len(list(dst.iterdir())) == 2
    with pytest.raises(raying.DataError, match="no Parquet files"):
        raying.Manifest.scan(str(dst), format="parquet")
    res = raying.pack(str(image_folder), str(dst), shard_rows=25, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == res.shards == [
        SHARD_NAME.format(k) for k in range(3)]
    assert len(raying.Manifest.scan(str(dst), format="parquet", label="label")) == 60


def test_a_pack_that_stops_part_way_leaves_no_shard(image_folder, tmp_path, ray_local):
    """One bad image under on_error="raise": the pack raises, and none of the shards written
    before stays to be scanned as a whole dataset (a later scan read 190 of 200 rows)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(image_folder, src)
    bad = sorted(src.rglob("*.jpg"))[-1]
    bad.write_bytes(b"not an image")
    dst = tmp_path / "out"
    with pytest.raises(raying.DataError, match=bad.name):
        raying.pack(str(src), str(dst), shard_rows=6, shuffle=False, on_error="raise",
                    progress=False)
    assert list(dst.iterdir()) == []  # no shard, and no marker once its tasks have ended
    from raying.dataset.pack import STOP_MARKER

    (dst / STOP_MARKER).write_bytes(b"")  # left by a stopped pack whose tasks outran it
    res = raying.pack(str(image_folder), str(dst), shard_rows=25, progress=False)
    assert res.rows == 60 and len(list(dst.glob("*.parquet"))) == 3  # every shard written


def test_a_stopped_pack_that_cannot_write_its_marker_still_waits_for_its_tasks(
        tmp_path, ray_local, caplog):
    """Where the stop marker cannot be written (a destination gone, a bucket missing), the
    shard tasks are still waited for, and no warning claims the marker holds them back."""
    import logging

    import pyarrow.fs as pafs
    import ray

    from raying.engine.pack import _remove_shards

    @ray.remote(num_cpus=0)
    def shard():
        time.sleep(0.5)
        return 1

    blocked = tmp_path / "a-file"  # a destination under a file: nothing can be written there
    blocked.write_bytes(b"")
    refs = [shard.remote() for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="raying"):
        _remove_shards(refs, pafs.LocalFileSystem(), str(blocked / "out"), ["_part-0.parquet"])
    assert ray.wait(refs, num_returns=2, timeout=0)[1] == []
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "keeps them from writing" not in said and "could not wait" not in said


def test_raying_pack_fails_when_every_sample_was_set_aside(tmp_path, ray_local, capsys):
    from raying.tools import cli

    src = tmp_path / "bad"
    src.mkdir()
    for k in range(4):
        (src / f"{k}.jpg").write_bytes(b"not an image")
    assert cli.main(["pack", str(src), str(tmp_path / "out"), "--verify", "--label",
                     "none"]) == 1
    assert "every one of the 4 samples was set aside" in capsys.readouterr().err


def test_pack_refuses_a_destination_inside_its_source(image_folder, packed, tmp_path,
                                                      ray_local):
    import shutil

    classes = sorted(p for p in image_folder.iterdir() if p.is_dir())
    link = tmp_path / "link"
    link.symlink_to(image_folder)
    for dst in (image_folder / classes[0].name, image_folder / "packed", image_folder,
                link / "packed"):
        with pytest.raises(raying.ConfigError, match=r"lies inside the source .*outside it"):
            raying.pack(str(image_folder), str(dst), progress=False)
    assert not list(image_folder.rglob("*.parquet")), "nothing written when refused"
    # A sibling whose name starts with the source's is outside it.
    sibling = image_folder.parent / (image_folder.name + "-packed")
    assert raying.pack(str(image_folder), str(sibling), shard_rows=100, progress=False).rows == 60
    # A source that is one file: a folder beside it is not part of it.
    (tmp_path / "one").mkdir()
    one = tmp_path / "one" / "train.parquet"
    shutil.copy(packed / "part-00000.parquet", one)
    res = raying.pack(str(one), str(tmp_path / "one" / "repacked"), progress=False,
                      label="label")
    assert res.rows == 25


def test_pack_a_flat_unlabelled_folder(image_folder, tmp_path, ray_local):
    flat = tmp_path / "flat"
    flat.mkdir()
    for k, f in enumerate(sorted(image_folder.rglob("*.jpg"))[:10]):
        (flat / f"{k:03d}.jpg").write_bytes(f.read_bytes())
    with pytest.raises(raying.RayingError, match="label=None"):
        raying.pack(str(flat), str(tmp_path / "out0"), progress=False)
    res = raying.pack(str(flat), str(tmp_path / "out"), progress=False, label=None)
    assert res.rows == 10
    with pytest.raises(raying.DataError, match="packed without labels.*label=None"):
        raying.Manifest.scan(str(tmp_path / "out"), format="parquet", label="label")
    back = raying.Manifest.scan(str(tmp_path / "out"), format="parquet", label=None)
    assert len(back) == 10 and set(back.labels.tolist()) == {-1}


def test_pack_an_image_folder_beside_a_parquet_file_says_which_with_format(image_folder,
                                                                          tmp_path, ray_local):
    import shutil

    src = tmp_path / "src"
    for f in sorted(image_folder.rglob("*.jpg"))[:6]:
        (src / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, src / f.parent.name / f.name)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"caption": ["x"]}), src / "captions.parquet")
    with pytest.raises(raying.ConfigError, match="format='images'"):
        raying.pack(str(src), str(tmp_path / "out"), progress=False)
    res = raying.pack(str(src), str(tmp_path / "out"), progress=False, format="images")
    assert res.rows == 6 and not res.skipped


def test_pack_parquet_with_captions_pre_decoded_then_read_with_them(tmp_path, ray_local):
    """A captioned Parquet set packed pre-decoded with its extra columns: the packed set
    scans with them, and every batch's caption, number and boxes belong to its image's
    source row; a pre-decoded source and a column named like pack's own are refused."""
    from tests.unit.dataset.test_pack import _captioned

    src = _captioned(tmp_path / "src")
    res = raying.pack(str(src), str(tmp_path / "out"), decode_size=16, shard_rows=10,
                      row_group_rows=4, progress=False, columns=["caption", "n", "boxes"])
    assert res.rows == 35 and [s["id"] for s in res.skipped] == [7]  # the null image
    m = raying.Manifest.scan(str(tmp_path / "out"), columns=["caption", "n", "boxes"])
    assert tuple(m.meta["decoded"]) == (16, 16, 3)
    source = _source_ids(m)
    assert sorted(source.tolist()) == [i for i in range(36) if i != 7]
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    seen = 0
    for b in pipe.iter_batches(batch_size=8, epoch=0):
        for i, caption, n, boxes in zip(b["id"], b["caption"], b["n"], b["boxes"],
                                        strict=True):
            s = int(source[int(i)])
            assert caption == f"sample {s}" and n == s * 10
            np.testing.assert_array_equal(boxes, np.full(s % 4, s + 0.5, np.float32))
            seen += 1
    assert seen == 35
    pipe.close()
    with pytest.raises(raying.ConfigError, match="pre-decoded pixels.*nothing to pack"):
        raying.pack(str(tmp_path / "out"), str(tmp_path / "again"), progress=False)
    with pytest.raises(raying.ConfigError, match=r"columns \['path'\] would overwrite"):
        raying.pack(str(tmp_path / "out"), str(tmp_path / "again"), progress=False,
                    columns=["path"])


def test_folder_epoch_every_id_once_with_label(image_folder, ray_local):
    m = raying.Manifest.scan(str(image_folder))
    assert len(m) == 60 and m.classes == ["class_00", "class_01", "class_02"]
    tf = raying.ImageTransform(size=32)
    pipe = raying.Pipeline(m, transform=tf, sampler=raying.UniformSampler(seed=3),
                           config=raying.PipelineConfig(block_rows=16))
    ids, labels = _epoch(pipe, 0)
    assert sorted(ids.tolist()) == list(range(60))
    truth = _truth(m)
    assert all(truth[i] == lab for i, lab in zip(ids.tolist(), labels.tolist(), strict=True))
    ids1, _ = _epoch(pipe, 1)
    assert sorted(ids1.tolist()) == list(range(60))
    assert ids1.tolist() != ids.tolist(), "a new epoch must come in a new order"
    again = raying.Pipeline(m, transform=tf, sampler=raying.UniformSampler(seed=3),
                            config=raying.PipelineConfig(block_rows=16))
    assert _epoch(again, 0)[0].tolist() == ids.tolist(), "same seed, same order"
    other = raying.Pipeline(m, transform=tf, sampler=raying.UniformSampler(seed=4),
                            config=raying.PipelineConfig(block_rows=16))
    assert _epoch(other, 0)[0].tolist() != ids.tolist()
    pipe.close()


def _source_ids(m) -> np.ndarray:
    """The packed rows' source ids (the ``id`` column), in the manifest's id order."""
    import pyarrow.parquet as pq

    return np.concatenate([pq.read_table(os.path.join(m.root, f), columns=["id"])
                           .column("id").to_numpy() for f in m.files])


def test_pack_shuffles_rows_so_row_groups_mix_classes_unless_told_not_to(image_folder,
                                                                          tmp_path, ray_local):
    src = raying.Manifest.scan(str(image_folder))
    classes = len(src.classes)
    out = {}
    for name, kwargs in (("shuffled", {}), ("again", {}), ("seed1", {"seed": 1}),
                         ("ordered", {"shuffle": False})):
        raying.pack(str(image_folder), str(tmp_path / name), shard_rows=25, row_group_rows=8,
                    progress=False, **kwargs)
        m = raying.Manifest.scan(str(tmp_path / name), format="parquet", label="label")
        source = _source_ids(m)
        # Every row keeps its source id, label and path.
        assert sorted(source.tolist()) == list(range(len(src)))
        assert np.array_equal(m.labels, src.labels[source])
        out[name] = (m, source)
    assert out["ordered"][1].tolist() == list(range(len(src)))
    assert np.array_equal(out["shuffled"][1], out["again"][1]), "the order is the seed's"
    assert not np.array_equal(out["shuffled"][1], out["seed1"][1])
    # Row groups: in folder order most hold one class; shuffled, they mix. Count the classes
    # per full row group of 8 (60 images in 3 classes, 20 each: a shuffled group of 8 holds
    # all 3 classes with probability ~0.88).
    def classes_per_group(m):
        f, g, start, rows = m.row_group_table()
        return [len(np.unique(m.labels[a:a + r])) for a, r in zip(start, rows, strict=True)
                if r == 8]

    ordered, shuffled = classes_per_group(out["ordered"][0]), classes_per_group(out["shuffled"][0])
    assert classes == 3 and np.mean(ordered) < 1.5 and np.mean(shuffled) > 2.5, (ordered,
                                                                               shuffled)


def test_parquet_epoch_matches_folder(image_folder, packed, ray_local):
    src = raying.Manifest.scan(str(image_folder))
    m = raying.Manifest.scan(str(packed), format="parquet", label="label")
    assert len(m) == 60
    assert m.classes == src.classes
    # The decoded cache off: epoch 1's rows would otherwise hit it or not depending on how far
    # its background writes got, and a row group read for a few missed rows counts all its
    # bytes as fetched but only theirs as delivered (1.43 seen on a loaded machine).
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                           sampler=raying.UniformSampler(seed=0),
                           config=raying.PipelineConfig(block_rows=16, decoded_cache="off"))
    ids, labels = _epoch(pipe, 0)
    assert sorted(ids.tolist()) == list(range(60))
    # Packing shuffles the rows; each keeps its source id, so labels agree with the folder's.
    source = _source_ids(m)
    assert sorted(source.tolist()) == list(range(60)) and source.tolist() != list(range(60))
    assert np.array_equal(labels[np.argsort(ids)], src.labels[source])
    ids1, _ = _epoch(pipe, 1)
    assert sorted(ids1.tolist()) == list(range(60)) and ids1.tolist() != ids.tolist()
    st = pipe.stats()
    assert st["skipped_count"] == 0
    # Uniform mode reads each window of row groups once per read worker: this 60-row epoch's
    # windows (4 groups, ~30 rows) are over its unit cap (16 rows, ~1/8 of the epoch), so each
    # is dealt into 2 parts, and a worker keeps a window for the parts that follow; with 2
    # workers at most 2 reads of each (1.73 seen; 1.0-1.2 when whole windows were units).
    assert 1.0 <= st["io"]["read_amplification"] <= 2.2, st["io"]
    # Memory counted whole: this process, every read worker that ran a unit (each measured
    # in its own process, so their pids differ from ours), and this node's tmpfs growth.
    mem = st["memory"]
    assert mem["read_workers"] >= 1 and mem["read_worker_mb_max"] > 20, mem
    assert all(not k.endswith(f":{os.getpid()}") for k in st["read_workers"]["by_worker"])
    assert mem["driver_mb"] > 20 and mem["tmpfs_growth_mb"] >= 0 and mem["decoded_cache_mb"] == 0
    assert mem["whole_mb"] == pytest.approx(
        mem["driver_mb"] + mem["read_workers_mb"] + mem["tmpfs_growth_mb"], abs=0.5)
    pipe.close()


def test_same_augmentation_for_same_seed(image_folder, ray_local):
    m = raying.Manifest.scan(str(image_folder))
    def first(seed):
        p = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                            sampler=raying.UniformSampler(seed=seed),
                            config=raying.PipelineConfig(block_rows=16))
        b = next(iter(p.iter_batches(batch_size=8, epoch=2)))
        p.close()
        return b
    a, b = first(5), first(5)
    assert np.array_equal(a["id"], b["id"]) and np.array_equal(a["image"], b["image"])


def test_torch_batch_contract(image_folder, ray_local):
    import torch

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                           config=raying.PipelineConfig(block_rows=16))
    batches = list(pipe.iter_torch_batches(batch_size=16, epoch=0, device="cpu"))
    assert sum(len(b["id"]) for b in batches) == 60
    b = batches[0]
    assert b["id"].dtype == torch.int64 and b["label"].dtype == torch.int64
    assert b["weight"].dtype == torch.float32 and b["prob"].dtype == torch.float64
    assert b["image"].dtype == torch.float32 and tuple(b["image"].shape) == (16, 3, 32, 32)
    assert b["image"].device.type == "cpu"
    assert torch.allclose(b["weight"], torch.ones(16))
    assert torch.allclose(b["prob"], torch.full((16,), 1 / 60, dtype=torch.float64))
    # Normalization: undo it and compare with the uint8 batch of the same epoch.
    raw = next(iter(pipe.iter_torch_batches(batch_size=16, epoch=0, device="cpu",
                                            normalize=False)))
    assert raw["image"].dtype == torch.uint8 and tuple(raw["image"].shape) == (16, 32, 32, 3)
    mean = torch.tensor(raying.options.DEFAULT_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(raying.options.DEFAULT_STD).view(1, 3, 1, 1)
    back = (b["image"] * std + mean) * 255.0
    assert torch.equal(raw["id"], b["id"])
    assert (back - raw["image"].permute(0, 3, 1, 2).float()).abs().max() < 1e-3
    pipe.close()


def test_to_tf_trains_keras_model(image_folder, ray_local):
    tf = pytest.importorskip("tensorflow")
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                           config=raying.PipelineConfig(block_rows=16))
    ds = pipe.to_tf(batch_size=16, epoch=0, normalize=True, as_supervised=True)
    model = tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)),
        tf.keras.layers.Conv2D(4, 3, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(3),
    ])
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(ds, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])
    dict_ds = pipe.to_tf(batch_size=16, epoch=0)
    first = next(iter(dict_ds))
    assert set(first) == {"id", "label", "image", "weight", "prob"}
    assert first["image"].dtype == tf.uint8
    # normalize with the caller's mean and std, as iter_torch_batches takes them.
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normed = next(iter(pipe.to_tf(batch_size=16, epoch=0, normalize=True, mean=mean,
                                  std=std)))
    want = (first["image"].numpy() / 255.0 - np.array(mean)) / np.array(std)
    assert normed["image"].dtype == tf.float32
    np.testing.assert_allclose(normed["image"].numpy(), want, atol=1e-5)
    with pytest.raises(raying.ConfigError, match="looks like the 0-255 scale"):
        pipe.to_tf(batch_size=16, normalize=True, mean=(124, 116, 104))
    pipe.close()


def test_dataset_for_ray_data(image_folder, ray_local):
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                           config=raying.PipelineConfig(block_rows=16))
    ds = pipe.dataset(epoch=0)
    ids = []
    for b in ds.iter_torch_batches(batch_size=16):
        ids.extend(b["id"].tolist())
        assert tuple(b["image"].shape[1:]) == (32, 32, 3)
    assert sorted(ids) == list(range(60))


def test_a_newer_iteration_supersedes_a_kept_iterator(image_folder, ray_local):
    """Peeking at a batch and keeping the iterator (its prefetch thread still pulling) must
    not cost the training epochs that follow any sample; the old iterator, used again, says
    it was superseded."""
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8))
    peek = pipe.iter_batches(batch_size=4, epoch=0, prefetch_batches=4)
    assert len(next(peek)["id"]) == 4
    for epoch in (0, 1, 2):
        ids = [i for b in pipe.iter_batches(batch_size=16, epoch=epoch) for i in b["id"]]
        assert sorted(ids) == list(range(60)), f"epoch {epoch}"
    with pytest.raises(raying.SupersededError, match="second Pipeline"):
        for _ in peek:
            pass
    pipe.close()


def test_epoch_must_be_a_non_negative_integer(image_folder, ray_local):
    pipe = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                           transform=raying.ImageTransform(size=16))
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(raying.ConfigError, match="epoch must be a non-negative integer"):
            next(pipe.iter_batches(batch_size=8, epoch=bad))
        with pytest.raises(raying.ConfigError, match="epoch must be a non-negative integer"):
            next(pipe.iter_torch_batches(batch_size=8, epoch=bad))
    assert sum(len(b["id"]) for b in pipe.iter_batches(batch_size=32, epoch=np.int64(1))) == 60
    pipe.close()


CLOSE_LOOP = r"""
import sys, ray, raying
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
m = raying.Manifest.scan(sys.argv[1])
for i in range(int(sys.argv[2])):
    p = raying.Pipeline(m, transform=raying.ImageTransform(size=8),
                        config=raying.PipelineConfig(block_rows=4, decoded_cache="off"))
    for k, b in enumerate(p.iter_batches(batch_size=5, epoch=0)):
        if k + 1 == 1 + i % 8:
            break
    p.close()
print("survived")
ray.shutdown()
"""


def test_breaking_and_closing_in_a_loop_never_aborts_the_driver(image_folder):
    """Closing a pipeline with read tasks in flight must be safe: cancelling streaming tasks
    as they complete aborted the driver inside Ray (3 of 6 runs of 300 loops; this test
    failed 1 of 3 runs of 300 before the fix, so it runs 600)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", CLOSE_LOOP, str(image_folder), "600"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "survived" in res.stdout, res.stderr[-2000:]


def test_keep_warm_reads_one_epoch_ahead_not_more(image_folder, ray_local):
    """Epochs of one read unit and a window of 4: only the next epoch starts early (it used to
    submit epochs 1-3 with epoch 0, decoding three epochs nobody had asked for)."""
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=64, window=4,
                                                        keep_warm=True, decoded_cache="off"))
    for epoch in (0, 1, 2):
        ids = [i for b in pipe.iter_batches(batch_size=64, epoch=epoch) for i in b["id"]]
        assert sorted(ids) == list(range(60))
        assert {key[0] for key in pipe._stream._inflight} == {epoch + 1}, list(
            pipe._stream._inflight)
    pipe.close()


def test_epochs_broken_off_in_their_last_unit_leave_nothing_being_read(image_folder,
                                                                        ray_local):
    """A loop that stops inside each epoch's last unit, while the next epoch already reads
    (keep_warm): the next epoch takes its running reads, and what the stopped one left being
    read goes (one ref per epoch stayed, pinning its unread blocks until close)."""
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=16, window=8,
                                                        decoded_cache="off"))
    for epoch in range(4):
        it = pipe.iter_batches(batch_size=8, epoch=epoch, prefetch_batches=0)
        seen = 0
        for b in it:
            seen += len(b["id"])
            if seen >= 56:  # 60 rows in units of 16: inside the last one
                break
        it.close()
        assert {key[0] for key in pipe._stream._reading} <= {epoch}, list(pipe._stream._reading)
        assert {key[0] for key in pipe._stream._nparts} <= {epoch, epoch + 1}
    pipe.close()


def test_start_with_an_epoch_reads_its_first_window_before_the_iteration_takes_it(
        image_folder, ray_local):
    """start(epoch=e) submits e's first window; iterating e takes those very tasks (their refs
    are the ones read) and gives the batches a pipeline that did not start early gives;
    iterating another epoch drops them; a resumed epoch is not read early."""
    m = raying.Manifest.scan(str(image_folder))

    def build():
        return raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=11),
                               config=raying.PipelineConfig(block_rows=8, window=3,
                                                            decoded_cache="off"))

    def batches(p, epoch):
        return [(b["id"].copy(), b["image"].copy())
                for b in p.iter_batches(batch_size=8, epoch=epoch)]

    plain = build()
    want = {e: batches(plain, e) for e in (1, 2)}
    plain.close()

    early = build().start(epoch=1)
    first = dict(early._stream._inflight)
    assert [k[:2] for k in first] == [(1, 0), (1, 1), (1, 2)]
    ray_local.wait([ref.completed() for ref in first.values()], num_returns=len(first),
                   timeout=60)  # the first window's reads ran before anyone iterated
    taken = []
    orig = early._stream._take
    early._stream._take = lambda key: (taken.append((key, early._stream._inflight.get(key)))
                                       or orig(key))
    got = batches(early, 1)
    early._stream._take = orig
    for (ia, xa), (ib, xb) in zip(got, want[1], strict=True):
        assert np.array_equal(ia, ib) and np.array_equal(xa, xb)
    seen = dict(taken)
    assert all(seen[key] is ref for key, ref in first.items())  # the early tasks, not new ones
    early.close()

    other = build().start(epoch=1)
    got = batches(other, 2)  # another epoch: the early reads are dropped, epoch 2 is whole
    assert [i.tolist() for i, _ in got] == [i.tolist() for i, _ in want[2]]
    other.close()

    resumed = build()
    it = resumed.iter_batches(batch_size=8, epoch=1)
    next(it)
    state = resumed.state_dict()
    del it
    resumed.close()
    again = build()
    again.load_state_dict(state)
    again.start(epoch=1)
    assert not again._stream._inflight  # the resume position decides what is read first
    rest = [i for i, _ in batches(again, 1)]
    assert sorted(np.concatenate([want[1][0][0], *rest]).tolist()) == list(range(len(m)))
    again.close()


@pytest.mark.parametrize("share, most", [(1e-9, 3), (0.75, 8)])
def test_units_in_flight_stay_within_the_object_store_share(image_folder, ray_local,
                                                            monkeypatch, share, most):
    """Decoded bytes in flight are bounded by a share of the object store: with a share
    smaller than one unit, only the minimum (a unit per CPU plus the one consumed) runs; with
    the default the window of 8 fills. Every id is read either way."""
    import raying.loader.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "DEFAULT_INFLIGHT_STORE_SHARE", share)
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, window=8,
                                                        keep_warm=True, decoded_cache="off"))
    stream = pipe._block_stream()
    seen: list[int] = []
    submit = stream._submit

    def counting(unit):
        submit(unit)
        seen.append(len(stream._inflight))

    monkeypatch.setattr(stream, "_submit", counting)
    for epoch in (0, 1, 2):
        ids = [i for b in pipe.iter_batches(batch_size=16, epoch=epoch) for i in b["id"]]
        assert sorted(ids) == list(range(60))
    assert max(seen) == most, seen
    pipe.close()



def _jitter(batch, rng):
    noise = rng.integers(0, 40, size=batch["image"].shape, dtype=np.uint8)
    return {**batch, "image": batch["image"] // 2 + noise}


@pytest.mark.parametrize(("stage", "block_rows"), [(None, 16), (_jitter, 16), (_jitter, 32)])
def test_a_unit_over_its_byte_share_runs_as_slices_with_the_same_rows(packed, ray_local,
                                                                      monkeypatch, stage,
                                                                      block_rows):
    """A window of 4 row groups (32 rows here) over its share of the byte budget runs as
    tasks of 16 rows each (one block, or half of one), on a Train worker's shard and on a
    pipeline of its own; the epoch's rows, their order and their pixels (a seeded user stage
    included) are those of the unsplit unit."""
    import raying.loader.pipeline as pipeline_module
    import raying.sampling.uniform as uniform_module

    # Units of whole windows (this 60-row epoch's would otherwise be dealt into parts of
    # ~1/8 of it, one block each: nothing left to slice).
    monkeypatch.setattr(uniform_module, "unit_rows_cap", lambda rows, block_rows: rows)
    m = raying.Manifest.scan(str(packed), format="parquet", label="label")

    def run(share, shard):
        monkeypatch.setattr(pipeline_module, "DEFAULT_INFLIGHT_STORE_SHARE", share)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                               sampler=raying.UniformSampler(seed=3, window_row_groups=4),
                               config=raying.PipelineConfig(block_rows=block_rows, window=4,
                                                            decoded_cache="off", shard=shard))
        if stage is not None:
            pipe = pipe.map_batches(stage, with_rng=True)
        stream = pipe._block_stream()
        tasks: list[tuple[int, int, int]] = []
        submit = stream._submit

        def counting(part):
            unit, _, k = part
            tasks.append((unit.epoch, unit.index, k))
            submit(part)

        monkeypatch.setattr(stream, "_submit", counting)
        got = [stream._part_rows]
        for epoch in (0, 1):
            blocks = list(pipe.iter_blocks(epoch))
            got.append((np.concatenate([b["id"] for b in blocks]),
                        np.concatenate([b["image"] for b in blocks])))
        units = pipe.plan(0).units
        pipe.close()
        return got, tasks, units

    alone, _, _ = run(1e-9, None)
    alone_whole, _, _ = run(0.75, None)
    assert alone[0] == 16 and alone_whole[0] >= 32, (alone[0], alone_whole[0])
    for (ids_w, img_w), (ids_s, img_s) in zip(alone_whole[1:], alone[1:], strict=True):
        assert np.array_equal(ids_w, ids_s) and np.array_equal(img_w, img_s)
    seen: list[int] = []
    parts = 0  # tasks beyond one per unit, both shards
    for rank in (0, 1):
        whole, tasks_whole, units = run(0.75, (rank, 2))
        split, tasks_split, _ = run(1e-9, (rank, 2))
        assert whole[0] >= 32 and split[0] == 16, (whole[0], split[0])
        for (ids_w, img_w), (ids_s, img_s) in zip(whole[1:], split[1:], strict=True):
            assert np.array_equal(ids_w, ids_s) and np.array_equal(img_w, img_s)
        seen.extend(split[1][0].tolist())
        # Split, a unit of n rows ran as ceil(n / 16) tasks, parts 0, 1, ...; whole, as one.
        assert max(k for _, _, k in tasks_whole) == 0
        per_unit: dict[tuple[int, int], list[int]] = {}
        for e, i, k in tasks_split:
            if e == 0:
                per_unit.setdefault((e, i), []).append(k)
        assert per_unit == {(0, u.index): list(range(-(-u.num_rows // 16))) for u in units}
        parts += sum(len(v) - 1 for v in per_unit.values())
    assert sorted(seen) == list(range(60))  # the two shards' epoch 0: every id once
    assert parts >= 2  # windows of up to 32 rows were split on the shards


def _mate(batch):
    """A stage without a generator that looks across its call's rows (a fixed mixup)."""
    return {**batch, "mate": np.roll(batch["id"], 1)}


@pytest.mark.parametrize("stage", [None, _jitter])
def test_an_epoch_s_last_units_run_as_slices_with_the_same_rows(image_folder, ray_local,
                                                               monkeypatch, stage):
    """The last units of every epoch (under a unit per core left) run as slices of whole
    batches, so the cores finish the epoch together; the epoch's rows, their order and their
    pixels (a seeded user stage included) are those of whole units."""
    import raying.engine.stream as stream_module

    monkeypatch.setattr(stream_module, "TAIL_MIN_ROWS", 8)  # 60 rows: units of 32
    m = raying.Manifest.scan(str(image_folder))

    def run(slices):
        monkeypatch.setattr(stream_module, "TAIL_SLICES", slices)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                               sampler=raying.UniformSampler(seed=5),
                               config=raying.PipelineConfig(decoded_cache="off"))
        if stage is not None:
            pipe = pipe.map_batches(stage, with_rng=True)
        stream = pipe._block_stream()
        tasks: list[tuple[int, int, int, int]] = []
        submit = stream._submit

        def counting(part):
            unit, _, k = part
            tasks.append((unit.epoch, unit.index, k, unit.num_rows))
            submit(part)

        monkeypatch.setattr(stream, "_submit", counting)
        got = []
        for epoch in (0, 1):  # epoch 1's units are submitted while epoch 0 drains
            batches = list(pipe.iter_batches(batch_size=16, epoch=epoch))
            got.append((np.concatenate([b["id"] for b in batches]),
                        np.concatenate([b["image"] for b in batches])))
        units = pipe.plan(0).units
        pipe.close()
        return got, tasks, units

    whole, tasks_whole, units = run(1)
    sliced, tasks_sliced, _ = run(4)
    for (ids_w, img_w), (ids_s, img_s) in zip(whole, sliced, strict=True):
        assert sorted(ids_w.tolist()) == list(range(60))
        assert np.array_equal(ids_w, ids_s) and np.array_equal(img_w, img_s)
    assert all(k == 0 for _, _, k, _ in tasks_whole)
    # Sliced: units of 32 and 28 rows (both under a unit per core from the end) ran as
    # slices of one 16-row batch, the remainder last.
    assert [u.num_rows for u in units] == [32, 28]
    for epoch in (0, 1):
        mine = sorted((i, k, n) for e, i, k, n in tasks_sliced if e == epoch)
        assert mine == [(0, 0, 16), (0, 1, 16), (1, 0, 16), (1, 1, 12)], mine


def test_a_stage_that_looks_across_rows_sees_the_same_calls_whether_or_not_units_split(
        tmp_path, ray_local, monkeypatch):
    """Slices start at multiples of block_rows; with block_rows not a multiple of the stage's
    call rows a split unit's calls would start elsewhere, and a stage that pairs rows within
    a call (without a generator) gave other rows on a machine of a smaller object store."""
    import raying.loader.pipeline as pipeline_module
    import raying.sampling.uniform as uniform_module
    from tests.unit.read.test_stages import write_parquet_set

    monkeypatch.setattr(uniform_module, "unit_rows_cap", lambda rows, block_rows: rows)
    root = write_parquet_set(tmp_path, files=((0, 800),), row_group_size=100)
    m = raying.Manifest.scan(str(root), format="parquet", label="label")

    def run(share):
        monkeypatch.setattr(pipeline_module, "DEFAULT_INFLIGHT_STORE_SHARE", share)
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               sampler=raying.UniformSampler(seed=2),
                               config=raying.PipelineConfig(block_rows=20, window=4,
                                                            decoded_cache="off"))
        pipe = pipe.map_batches(_mate)
        blocks = list(pipe.iter_blocks(0))
        pipe.close()
        return [np.concatenate([b[k] for b in blocks]) for k in ("id", "mate")]

    tight, roomy = run(1e-9), run(0.75)
    assert np.array_equal(tight[0], roomy[0])
    assert np.array_equal(tight[1], roomy[1])


def _slow(batch):
    import time

    time.sleep(0.2)
    return batch


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_iterator_of_a_pipeline_closed_under_it_says_it_was_closed(image_folder, ray_local,
                                                                      prefetch):
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache="off"))
    it = pipe.iter_batches(batch_size=4, epoch=0, prefetch_batches=prefetch)
    next(it)
    pipe.close()
    with pytest.raises(raying.ConfigError, match=r"closed while this iterator ran"):
        for _ in it:
            pass


def test_close_stops_the_prefetch_thread_of_an_iterator_still_held(image_folder, ray_local):
    """An iterator the consumer still holds (not exhausted, not closed) when the pipeline
    closes: its prefetch thread stops with close() (it kept running, holding its queued
    batches, until the next next()), and that next() says the pipeline was closed."""
    import threading

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache="off"))
    it = pipe.iter_batches(batch_size=4, epoch=0, prefetch_batches=2)
    next(it)
    threads = [t for t in threading.enumerate() if t.name == "raying-prefetch"]
    assert threads
    pipe.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(raying.ConfigError, match=r"closed"):
        next(it)


def test_close_waits_for_running_reads_before_it_frees_the_decoded_cache(image_folder,
                                                                         ray_local, monkeypatch):
    """The next epoch's first read tasks still run when the trainer closes the pipeline; they
    write cache entries, so close() lets them finish before it removes the cache (else a
    late writer leaves a directory behind on its node)."""
    import ray

    from raying.engine.stream import BlockStream
    from raying.read import decoded_dirs

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, window=4, keep_warm=True,
                                                        decoded_cache=32 * 2**20,
                                                        decoded_cache_fill=None)
                           ).map_batches(_slow)
    assert sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=0)) == 60
    dropped: list = []
    close = BlockStream.close

    def recording(self):
        dropped.extend(close(self))
        return dropped

    monkeypatch.setattr(BlockStream, "close", recording)
    pipe.close()
    assert dropped, "the next epoch's reads were in flight at close()"
    done, _ = ray.wait([t.completed() for t in dropped], num_returns=len(dropped), timeout=0)
    assert len(done) == len(dropped)
    assert not os.path.exists(decoded_dirs.cache_dir(pipe._cache_name))


def test_a_pipeline_dropped_without_close_frees_its_decoded_cache_when_collected(image_folder,
                                                                                ray_local):
    """tmpfs is memory: a pipeline abandoned mid-epoch (an exception in the loop, no close)
    frees this node's decoded pixels once it is garbage, not at the process's exit."""
    import gc

    from raying.read import decoded_dirs

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=8, decoded_cache=32 * 2**20,
                                                        decoded_cache_fill=None))
    with pytest.raises(KeyError):
        for _ in pipe.iter_batches(batch_size=16, epoch=0):
            raise KeyError("the trainer's own bug")
    path = decoded_dirs.cache_dir(pipe._cache_name)
    assert os.path.isdir(path)
    del pipe
    gc.collect()
    assert not os.path.exists(path)


def test_a_shard_queues_read_tasks_for_its_share_of_the_cores(image_folder, ray_local):
    """A Train worker's shard keeps a window for its share of the cluster's cores, so the
    tasks of a worker that runs ahead do not hold the cores the others wait for."""
    import ray

    from raying.options import DEFAULT_INFLIGHT_TASKS_PER_CPU

    cpus = int(ray.cluster_resources()["CPU"])
    m = raying.Manifest.scan(str(image_folder))
    windows = {}
    for shard in (None, (0, 2), (1, cpus)):
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=32),
                               config=raying.PipelineConfig(block_rows=16, shard=shard))
        windows[shard] = pipe.start()._stream._window
        pipe.close()
    assert windows[None] == max(2, DEFAULT_INFLIGHT_TASKS_PER_CPU * cpus)
    assert windows[(0, 2)] == max(2, DEFAULT_INFLIGHT_TASKS_PER_CPU * -(-cpus // 2))
    assert windows[(1, cpus)] == max(2, DEFAULT_INFLIGHT_TASKS_PER_CPU)


def _task_cpus(batch):
    import ray

    got = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    return {**batch, "task_cpus": np.full(len(batch["id"]), got, dtype=np.float64)}


def test_dataset_read_tasks_reserve_what_the_iterator_s_do(image_folder, ray_local):
    """PipelineConfig(task_num_cpus=...) sizes the read tasks of pipe.dataset(e) too (they
    reserved Ray Data's one CPU); ray_remote_args' num_cpus still decides where given."""
    m = raying.Manifest.scan(str(image_folder))
    for config, want in ((dict(task_num_cpus=0.5), 0.5),
                         (dict(task_num_cpus=0.5, ray_remote_args={"num_cpus": 0.25}), 0.25)):
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(**config)).map_batches(_task_cpus)
        try:
            it = {float(x) for b in pipe.iter_batches(batch_size=32) for x in b["task_cpus"]}
            ds = {float(x) for b in pipe.dataset(0).iter_batches(batch_size=32)
                  for x in b["task_cpus"]}
            assert it == ds == {want}, (config, it, ds)
        finally:
            pipe.close()


def test_threads_taking_their_first_datasets_at_once_share_one_account(image_folder,
                                                                      ray_local, monkeypatch):
    """Two threads calling dataset(e) for the first time together: each made an account
    actor, the second replaced the first, and the first dataset's reads left stats()."""
    import threading
    import time

    import raying.loader.pipeline as pipeline_module

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    made, original = [], pipeline_module.DatasetReads

    def slow(*args, **kwargs):  # the actor's start takes a while, as on a busy node
        time.sleep(0.2)
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "DatasetReads", slow)
    try:
        rows: list[int] = []
        threads = [threading.Thread(target=lambda e=e: rows.append(pipe.dataset(e).count()))
                   for e in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert made == [1] and rows == [len(m), len(m)]
        assert pipe.stats(sampling=False)["dataset"]["rows_read"] == 2 * len(m)
    finally:
        pipe.close()


def test_a_dataset_iterated_after_its_pipeline_closed_says_so(image_folder, ray_local):
    pipe = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                           transform=raying.ImageTransform(size=16))
    ds = pipe.dataset(0)
    assert sum(len(b["id"]) for b in ds.iter_batches(batch_size=16)) == len(pipe.manifest)
    pipe.close()
    with pytest.raises(raying.ConfigError, match=r"this dataset's pipeline was closed, or "
                                                 r"its account .* iterate pipe.dataset\(e\) "
                                                 r"before "
                                                 r"pipe.close\(\)"):
        list(ds.iter_batches(batch_size=16))


def test_a_closed_pipeline_holds_no_dataset_objects(image_folder, ray_local):
    """close() lets go of what dataset(e) put in the object store (the read spec, the label
    lookup: 8 B a sample): they stayed pinned for as long as the closed Pipeline lived."""
    import gc

    import ray
    from ray._private.internal_api import memory_summary

    pipe = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                           transform=raying.ImageTransform(size=16))
    assert pipe.dataset(0).count() == len(pipe.manifest)
    reads = pipe._dataset_reads
    hexes = [reads.spec_ref.hex(), reads.lookup_ref.hex()]
    assert all(h in memory_summary(stats_only=False) for h in hexes)
    pipe.close()
    gc.collect()
    assert reads.spec_ref is None and reads.lookup_ref is None

    deadline = time.monotonic() + 20
    while any(h in memory_summary(stats_only=False) for h in hexes):
        assert time.monotonic() < deadline, "the dataset's objects stay in the store"
        time.sleep(0.5)
    ray.get(ray.put(0))  # the store still answers


def test_a_dataset_s_account_actor_lives_on_the_head(image_folder, ray_local):
    """As the priority store: on a worker node (a spot instance) its loss restarted it
    empty, and stats() lost the counts and skips of the reads so far."""
    import ray

    from raying.sampling.store import HEAD_NODE_RESOURCE

    pipe = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                           transform=raying.ImageTransform(size=16))
    try:
        before = ray.available_resources().get(HEAD_NODE_RESOURCE)
        assert before is not None
        assert pipe.dataset(0).count() == len(pipe.manifest)
        assert ray.available_resources()[HEAD_NODE_RESOURCE] < before  # held by the actor
    finally:
        pipe.close()


def test_a_dataset_s_account_actor_lost_with_its_process_comes_back(image_folder, ray_local):
    """The account actor of pipe.dataset(e)'s reads dies (an OOM kill of its process): it
    restarts, and the next datasets read and count (the pipeline was not closed)."""
    import ray

    pipe = raying.Pipeline(raying.Manifest.scan(str(image_folder)),
                           transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(decoded_cache="off"))
    n = len(pipe.manifest)
    try:
        assert sum(len(b["id"]) for b in pipe.dataset(0).iter_batches(batch_size=16)) == n
        ray.kill(pipe._dataset_reads.accounts, no_restart=False)  # as a crash does
        for epoch in (1, 2):
            ids = np.concatenate([b["id"] for b in
                                  pipe.dataset(epoch).iter_batches(batch_size=16)])
            assert sorted(ids.tolist()) == list(range(n))
        assert pipe.stats(sampling=False)["dataset"]["rows_read"] >= n
    finally:
        pipe.close()


def test_a_pipeline_built_again_under_a_closed_one_s_name_has_its_decoded_cache(image_folder,
                                                                                ray_local):
    """A fixed PipelineConfig(name=...) (for priority snapshots) is reused by each run or
    phase: the closed pipeline's tombstone must not turn the next one's cache off."""
    m = raying.Manifest.scan(str(image_folder))

    def hits() -> int:
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(name="fixed-name", block_rows=8,
                                                            decoded_cache=32 * 2**20,
                                                            decoded_cache_fill=None))
        for e in range(2):
            assert sum(len(b["id"]) for b in pipe.iter_batches(batch_size=16, epoch=e)) == 60
        io = pipe.stats()["io"]
        pipe.close()
        return io.get("cache_decoded_hits", 0)

    first = hits()
    assert first > 0
    # (Hits vary by a few between runs: the next epoch's first reads may start before the
    # last cache writes of the epoch before land.) The old tombstone gave 0.
    assert hits() >= first // 2


def _stamp(batch):
    """Writes each row's id into its red channel: a batch must still show its own ids after
    later batches were joined (straddling batches reuse arrays nothing refers to)."""
    image = batch["image"].copy()
    image[..., 0] = (batch["id"] % 251).astype(np.uint8)[:, None, None]
    batch["image"] = image
    return batch


def _stamped(image, ids) -> bool:
    image = np.asarray(image)
    return bool(np.all(image[..., 0] == (np.asarray(ids) % 251).astype(np.uint8)[:, None, None]))


def test_straddling_batches_a_trainer_keeps_stay_its_own_in_numpy_torch_and_tf(image_folder,
                                                                               ray_local):
    # 224 px rows (150 KB) in batches of 12 across blocks of 10 rows: every batch straddles
    # two blocks and is joined into a reused array (1.8 MB each).
    pipe = raying.Pipeline(raying.Manifest.scan(image_folder),
                           transform=raying.ImageTransform(size=224),
                           config=raying.PipelineConfig(block_rows=10)).map_batches(_stamp)
    try:
        assert pipe.block_rows() == 10
        kept = list(pipe.iter_batches(batch_size=12, epoch=0))
        assert sorted(np.concatenate([b["id"] for b in kept]).tolist()) == list(range(60))
        assert all(_stamped(b["image"], b["id"]) for b in kept)

        held = [(b["image"], b["id"]) for b in pipe.iter_torch_batches(
            batch_size=12, epoch=1, device="cpu", normalize=False)]
        assert all(_stamped(image.numpy(), ids.numpy()) for image, ids in held)

        ds = pipe.to_tf(batch_size=12, epoch=2).prefetch(8)
        got = list(ds.as_numpy_iterator())
        assert sum(len(b["id"]) for b in got) == 60
        assert all(_stamped(b["image"], b["id"]) for b in got)
    finally:
        pipe.close()


def test_read_tasks_no_node_can_host_are_named_at_start(image_folder, ray_local, caplog):
    # Each read task would wait for a node with 3 CPUs: the first batch with them, for ever.
    import logging

    m = raying.Manifest.scan(str(image_folder))
    for cpus, warned in ((3, True), (2, False)):
        pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                               config=raying.PipelineConfig(task_num_cpus=cpus))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="raying"):
            pipe.start()
        said = [r.getMessage() for r in caplog.records if "task_num_cpus" in r.getMessage()]
        assert bool(said) is warned, said
        if warned:
            assert "the largest has 2" in said[0] and "task_num_cpus <= 2" in said[0]
        else:
            assert len(next(pipe.iter_batches(batch_size=8))["id"]) == 8
        pipe.close()


def test_a_parquet_file_of_one_row_group_is_read_in_parallel_and_shared_evenly(tmp_path,
                                                                             ray_local):
    """pyarrow and pandas write a file as one row group: its epoch was one read task (one
    core decoding) and gave one Train share every row, the other none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raying.tools.datagen import encode

    rng = np.random.default_rng(0)
    images = [encode(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8), "png")
              for _ in range(600)]
    pq.write_table(pa.table({"image": images, "label": np.arange(600) % 3}),
                   tmp_path / "one.parquet")
    m = raying.Manifest.scan(str(tmp_path / "one.parquet"))
    assert len(m.row_group_table()[3]) == 1
    whole = raying.Pipeline(m, config=raying.PipelineConfig(block_rows=32))
    units = whole.plan(0).units
    assert len(units) == 8  # parts of ~1/8 of the epoch, in whole blocks of 32
    largest = max(u.num_rows for u in units)
    ids = np.concatenate([b["id"] for b in whole.iter_batches(batch_size=50, epoch=0)])
    whole.close()
    assert sorted(ids.tolist()) == list(range(600))
    shares = [raying.Pipeline(m, config=raying.PipelineConfig(block_rows=32, shard=(i, 2)))
              for i in range(2)]
    got = [np.concatenate([b["id"] for b in p.iter_batches(batch_size=50, epoch=1)])
           for p in shares]
    later = np.concatenate([b["id"] for b in shares[0].iter_batches(batch_size=50, epoch=2)])
    for p in shares:
        p.close()
    assert sorted(np.concatenate(got).tolist()) == list(range(600))  # every id once
    assert abs(len(got[0]) - len(got[1])) <= largest  # shares differ by one unit at most
    assert largest <= 96 and min(len(g) for g in got) >= 250  # parts of ~75 rows in blocks
    # Each epoch deals the group afresh: a share does not read the same rows every epoch.
    assert len(set(later.tolist()) & set(got[0].tolist())) < 200


def test_a_share_that_gets_no_rows_of_an_epoch_says_so_once(tmp_path, ray_local, caplog):
    """A dataset of fewer read units than workers leaves a share empty: its worker's loop
    ends at once while the others train (a DDP all-reduce would wait for it), so it warns."""
    import logging

    from raying.tools.datagen import make_image_folder

    m = raying.Manifest.scan(str(make_image_folder(tmp_path / "img", n=10, classes=2,
                                                   size=(16, 16))))
    shares = [raying.Pipeline(m, transform=raying.ImageTransform(size=8),
                              config=raying.PipelineConfig(shard=(i, 2))) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="raying"):
        rows = [sum(len(b["id"]) for e in range(2) for b in p.iter_batches(batch_size=4,
                                                                            epoch=e))
                for p in shares]
    for p in shares:
        p.close()
    assert sorted(rows) == [0, 20]
    said = [r.getMessage() for r in caplog.records if "got no rows" in r.getMessage()]
    assert len(said) == 1 and "the epoch has 1 read units of up to 32 rows for 2" in said[0]


def test_stats_count_read_units_not_their_blocks(tmp_path, ray_local):
    """An epoch's first units come in a short first block and the rest (the first batch
    sooner): stats()["units"] counts each once."""
    from raying.tools.datagen import make_image_folder

    m = raying.Manifest.scan(str(make_image_folder(tmp_path / "img", n=8 * 128, classes=2,
                                                   size=(8, 8))))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=8),
                           config=raying.PipelineConfig(block_rows=128, decoded_cache="off"))
    rows = sum(len(b["id"]) for b in pipe.iter_batches(batch_size=4, epoch=0))
    units = len(pipe.plan(0).units)
    got = pipe.stats(sampling=False)["units"]
    pipe.close()
    assert rows == len(m) and units > 1 and got == units


def _crash_on_id_30(batch):
    if 30 in batch["id"]:
        os._exit(1)  # the read's worker process dies
    return batch


def test_a_read_lost_with_its_worker_stops_the_epoch_and_drops_its_reads(image_folder,
                                                                         ray_local):
    import ray

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=0, shuffle=False),
                           config=raying.PipelineConfig(
                               block_rows=8, window=4, ray_remote_args={"max_retries": 0}))
    pipe = pipe.map_batches(_crash_on_id_30)
    with pytest.raises(ray.exceptions.RayError):
        for _ in pipe.iter_batches(batch_size=8, epoch=0):
            pass
    stream = pipe._stream
    assert not stream._inflight and not stream._reading and not stream._pending
    pipe.close()
    again = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                            config=raying.PipelineConfig(block_rows=8))
    ids = np.concatenate([b["id"] for b in again.iter_batches(batch_size=8, epoch=0)])
    assert len(ids) == 60  # the node reads on
    again.close()


def test_the_next_epoch_takes_its_warm_reads_while_a_stopped_one_still_holds_some(
        image_folder, ray_local, monkeypatch):
    """A loop stopped inside epoch 0 whose iteration has not let go of its reads yet (its
    thread still waiting on a block): epoch 1 takes the reads keep_warm started for it, and
    epoch 0's go (they made epoch 1 drop its warm reads and read them again)."""
    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           sampler=raying.UniformSampler(seed=5),
                           config=raying.PipelineConfig(block_rows=8, window=6,
                                                        decoded_cache="off"))
    stream = pipe._block_stream()
    monkeypatch.setattr(stream, "_drop_epoch", lambda epoch, mine: None)  # not let go yet
    it = pipe.iter_batches(batch_size=8, epoch=0, prefetch_batches=0)
    seen = 0
    for b in it:
        seen += len(b["id"])
        if seen >= 48:  # inside unit 5 of 8: epoch 1's first units already submitted
            break
    it.close()
    warm = {k: r for k, r in stream._inflight.items() if k[0] == 1}
    assert warm and any(k[0] == 0 for k in (*stream._inflight, *stream._reading))
    taken = []
    orig = stream._take
    monkeypatch.setattr(stream, "_take", lambda key: (
        taken.append((key, stream._inflight.get(key))) or orig(key)))
    ids = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=8, epoch=1)])
    assert sorted(ids.tolist()) == list(range(60))
    got = dict(taken)
    assert all(got[key] is ref for key, ref in warm.items())  # the warm tasks, not new ones
    assert not [k for k in (*stream._inflight, *stream._reading) if k[0] == 0]
    pipe.close()


def test_raying_pack_takes_the_class_names_of_another_split(image_folder, tmp_path,
                                                           ray_local):
    """A validation split missing a class packs with the training split's names (the pack's
    own warning pointed at a --classes it did not have)."""
    import shutil

    from raying.tools import cli

    train = raying.Manifest.scan(str(image_folder))
    val = tmp_path / "val"
    shutil.copytree(image_folder, val)
    shutil.rmtree(val / train.classes[0])  # the first class has no image here
    out = tmp_path / "out"
    assert cli.main(["pack", str(val), str(out), "--json",
                     "--classes", ",".join(train.classes)]) == 0
    import pyarrow.parquet as pq

    packed = raying.Manifest.scan(str(out), format="parquet", label="label")
    assert packed.classes == train.classes
    rows = pq.read_table(str(out), columns=["path", "label"]).to_pylist()
    assert len(rows) == len(packed) and {r["label"] for r in rows} == set(
        range(1, len(train.classes)))
    assert all(r["label"] == train.classes.index(r["path"].split("/")[0]) for r in rows)


def test_a_second_pass_without_epoch_says_it_reads_epoch_0_again(image_folder, ray_local):
    """A loop written for a DataLoader (`for _ in range(E): for b in pipe.iter_batches()`)
    trained on the same order and the same crops every pass, without a word."""
    import warnings

    m = raying.Manifest.scan(str(image_folder))
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the first pass, and epoch=0 passed: nothing said
            first = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=16)])
            again = np.concatenate([b["id"] for b in pipe.iter_batches(batch_size=16,
                                                                       epoch=0)])
        assert np.array_equal(first, again)
        with pytest.warns(UserWarning, match=r"iter_torch_batches\(\) without epoch= reads "
                                             r"epoch 0 again.*pass epoch=e"):
            for _ in pipe.iter_torch_batches(batch_size=16, normalize=False):
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            list(pipe.iter_batches(batch_size=16))
    finally:
        pipe.close()
