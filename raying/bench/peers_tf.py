"""tf.data as the TensorFlow guides write an ImageNet input pipeline: native ops, AUTOTUNE.

- Image folders: ``from_tensor_slices((paths, labels))`` -> ``shuffle(N,
  reshuffle_each_iteration=True)`` -> ``map(read_file -> extract_jpeg_shape ->
  sample_distorted_bounding_box -> decode_and_crop_jpeg -> resize 224 -> uint8 ->
  random_flip_left_right, num_parallel_calls=AUTOTUNE)`` -> ``batch(B)`` ->
  ``prefetch(AUTOTUNE)``. ``sample_distorted_bounding_box`` with torchvision's ranges (area
  0.08-1, aspect 3/4-4/3, 10 attempts, whole image as fallback) plus ``decode_and_crop_jpeg``
  is TF's native random-resized-crop: only the crop window is decoded.
- ``tf-cache`` (a labelled row, image folders): whole JPEGs decoded once and kept by
  ``.cache()``, then a shuffle buffer and the crop of the cached pixels every epoch.
- Parquet (W3, W4): ``from_generator`` over row groups (permuted every epoch, rows shuffled
  within each group, read with pyarrow) yielding one group at a time -> ``unbatch`` -> the
  same ``map`` on the JPEG bytes (W3), or ``random_crop`` 224 + flip of the stored pixels (W4)
  -> ``batch`` -> ``prefetch``.

TF's thread pools are left at their defaults (all cores). Batches stay ``tf.Tensor`` (uint8
NHWC on the host); the bench only reads their shape.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from raying.bench.kernels import CROP_RATIO, CROP_SCALE  # noqa: E402
from raying.bench.workloads import (  # noqa: E402
    OUTPUT_SIZE,
    Workload,
    list_images,
    parquet_files,
    row_groups,
)

_NO_BOXES = tf.zeros([1, 0, 4], dtype=tf.float32)


def _sample_box(shape: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(begin, size)`` of a random-resized-crop box in an image of ``shape`` (h, w, c):
    torchvision's ranges, 10 attempts, the whole image as fallback."""
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=_NO_BOXES, min_object_covered=0.0,
        aspect_ratio_range=CROP_RATIO, area_range=CROP_SCALE, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    return begin, size


def _to_output(image: tf.Tensor) -> tf.Tensor:
    """A crop resized to 224 (bilinear), rounded to uint8, mirrored half the time."""
    image = tf.image.resize(image, [OUTPUT_SIZE, OUTPUT_SIZE], method="bilinear")
    image = tf.cast(tf.clip_by_value(image + 0.5, 0.0, 255.0), tf.uint8)
    return tf.image.random_flip_left_right(image)


def _crop_decode(data: tf.Tensor) -> tf.Tensor:
    """JPEG bytes -> random-resized-crop 224 uint8, mirrored half the time."""
    begin, size = _sample_box(tf.image.extract_jpeg_shape(data))
    top, left, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    image = tf.image.decode_and_crop_jpeg(data, tf.stack([top, left, height, width]),
                                          channels=3)
    return _to_output(image)


def _load_file(path: tf.Tensor, label: tf.Tensor):
    return _crop_decode(tf.io.read_file(path)), label


def _load_bytes(data: tf.Tensor, label: tf.Tensor):
    return _crop_decode(data), label


def _crop_pixels(pixels: tf.Tensor, label: tf.Tensor):
    image = tf.image.random_crop(pixels, [OUTPUT_SIZE, OUTPUT_SIZE, 3])
    return tf.image.random_flip_left_right(image), label


_GRAY = tf.constant([0.299, 0.587, 0.114], dtype=tf.float32)


def _jitter(images: tf.Tensor, labels: tf.Tensor):
    """W7's colour jitter as TF ops on a batch (kernels.colour_jitter's math): brightness,
    contrast against the image mean, saturation against grayscale, each 1 +- 0.4."""
    from raying.bench.kernels import JITTER

    n = tf.shape(images)[0]
    f = tf.random.uniform([n, 1, 1, 3], 1.0 - JITTER, 1.0 + JITTER)
    x = tf.clip_by_value(tf.cast(images, tf.float32) * f[..., 0:1], 0.0, 255.0)
    gray = tf.reduce_sum(x * _GRAY, axis=-1, keepdims=True)
    mean = tf.reduce_mean(gray, axis=[1, 2, 3], keepdims=True)
    x = tf.clip_by_value((x - mean) * f[..., 1:2] + mean, 0.0, 255.0)
    gray = tf.reduce_sum(x * _GRAY, axis=-1, keepdims=True)
    x = tf.clip_by_value((x - gray) * f[..., 2:3] + gray, 0.0, 255.0)
    return tf.cast(x, tf.uint8), labels


def _decode_file(path: tf.Tensor, label: tf.Tensor):
    """The whole JPEG, decoded (what tf-cache keeps)."""
    return tf.io.decode_jpeg(tf.io.read_file(path), channels=3), label


def _crop_decoded(image: tf.Tensor, label: tf.Tensor):
    """Random-resized-crop 224 + flip of decoded pixels: the same box sampling as
    ``_crop_decode``, on the cached image instead of the JPEG."""
    begin, size = _sample_box(tf.shape(image))
    return _to_output(tf.slice(image, begin, size)), label


def _row_group_dataset(files: list[str], decoded: int | None, seed: int) -> tf.data.Dataset:
    import pyarrow.parquet as pq

    groups = row_groups(files)
    handles = [pq.ParquetFile(f) for f in files]
    epochs = [0]

    def gen():
        rng = np.random.default_rng([seed, epochs[0]])
        epochs[0] += 1
        for gi in rng.permutation(len(groups)):
            f, g, _ = groups[gi]
            table = handles[f].read_row_group(int(g), columns=["image", "label"])
            perm = rng.permutation(table.num_rows)
            labels = table.column("label").to_numpy()[perm]
            if decoded:
                col = table.column("image").combine_chunks()
                s = decoded
                flat = np.frombuffer(col.buffers()[1], dtype=np.uint8)
                pixels = flat[col.offset * s * s * 3:(col.offset + len(col)) * s * s * 3]
                yield pixels.reshape(len(col), s, s, 3)[perm], labels
            else:
                datas = table.column("image").to_pylist()
                yield np.array([datas[i] for i in perm], dtype=object), labels

    if decoded:
        sig = (tf.TensorSpec([None, decoded, decoded, 3], tf.uint8),
               tf.TensorSpec([None], tf.int64))
    else:
        sig = (tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.int64))
    return tf.data.Dataset.from_generator(gen, output_signature=sig).unbatch()


class _TfLoader:
    def __init__(self, ds: tf.data.Dataset) -> None:
        self.ds = ds

    def epoch(self, e: int) -> Iterator[tuple[Any, Any]]:
        yield from self.ds

    def close(self) -> None:
        self.ds = None


class TfPeer:
    """tf.data with AUTOTUNE and TF's native JPEG ops."""

    def start(self, cores: int) -> dict[str, Any]:
        return {"tf_version": tf.__version__}

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TfLoader:
        tf.random.set_seed(seed)
        auto = tf.data.AUTOTUNE
        if wl.kind == "images":
            paths, labels, _ = list_images(wl.root)
            ds = tf.data.Dataset.from_tensor_slices((paths, labels))
            ds = ds.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
            ds = ds.map(_load_file, num_parallel_calls=auto)
        else:
            ds = _row_group_dataset(parquet_files(wl.root), wl.decoded, seed)
            ds = ds.map(_crop_pixels if wl.decoded else _load_bytes, num_parallel_calls=auto)
        ds = ds.batch(batch_size)
        if wl.augment:  # W7: vectorized over the batch, as tf.data users write it
            ds = ds.map(_jitter, num_parallel_calls=auto)
        return _TfLoader(ds.prefetch(auto))

    def stop(self) -> None:
        pass


# Decoded images tf-cache's shuffle buffer holds (~100 MB of 256-px images).
DEFAULT_TF_CACHE_SHUFFLE = 512


class TfCachePeer(TfPeer):
    """tf.data's own decoded cache, a labelled row beside raying-cache: the file list shuffled
    once, whole JPEGs decoded and kept by ``.cache()`` (in memory) in the first epoch, then
    every epoch a shuffle buffer of ``DEFAULT_TF_CACHE_SHUFFLE`` decoded images and the
    random-resized-crop + flip of the cached pixels. Image folders only."""

    def open(self, wl: Workload, *, batch_size: int, cores: int, seed: int) -> _TfLoader:
        tf.random.set_seed(seed)
        auto = tf.data.AUTOTUNE
        paths, labels, _ = list_images(wl.root)
        ds = tf.data.Dataset.from_tensor_slices((paths, labels))
        ds = ds.shuffle(len(paths), seed=seed, reshuffle_each_iteration=False)
        ds = ds.map(_decode_file, num_parallel_calls=auto).cache()
        ds = ds.shuffle(DEFAULT_TF_CACHE_SHUFFLE, seed=seed, reshuffle_each_iteration=True)
        ds = ds.map(_crop_decoded, num_parallel_calls=auto).batch(batch_size)
        return _TfLoader(ds.prefetch(auto))

