"""Tests of raying.image.transform: crop semantics, counter-based randomness, the batch hot path."""

from __future__ import annotations

import io
import math

import cv2
import numpy as np
import pytest
import simplejpeg
from PIL import Image

from raying.errors import ConfigError, DecodeError
from raying.image import rng as _rng
from raying.image.decode import decode_image
from raying.image.transform import ImageTransform, TransformResult
from tests.corpus.images import make_image_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_image_corpus(tmp_path_factory.mktemp("corpus"), n_good=12, seed=1)


def _smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Photo-like content: smooth random texture, so resampling differences stay small."""
    rng = np.random.default_rng(seed)
    grid = rng.uniform(0, 255, size=(max(2, h // 24), max(2, w // 24), 3)).astype(np.float32)
    return np.clip(cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC), 0, 255).astype(
        np.uint8)


def _jpegs(n: int, h: int, w: int, quality: int = 90) -> list[bytes]:
    return [simplejpeg.encode_jpeg(_smooth(h, w, i), quality=quality) for i in range(n)]


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"size": 0}, "ImageTransform size must be a positive integer, got 0"),
    ({"size": 22.5}, "ImageTransform size must be a positive integer, got 22.5"),
    ({"scale": (0.5, 0.1)}, r"ImageTransform scale must satisfy 0 < min <= max < inf, got \(0.5, 0.1\)"),
    ({"scale": (0.1, 2.0)}, r"at most 1.0, got \(0.1, 2.0\)"),
    ({"scale": 0.5}, "ImageTransform scale must be a pair of numbers"),
    ({"ratio": (0.0, 1.0)}, r"ImageTransform ratio must satisfy 0 < min <= max < inf, got "
                            r"\(0.0, 1.0\)"),
    ({"ratio": (1.0, float("inf"))}, r"ratio must satisfy 0 < min <= max < inf, got \(1.0, inf\)"),
    ({"resize": 100}, r"ImageTransform resize \(100\) must be >= size \(224\)"),
    ({"interpolation": "bilinear"}, "interpolation must be one of .*got 'bilinear'"),
    ({"flip": 1}, "ImageTransform flip must be True or False, got 1"),
    ({"random_crop": "yes"}, "random_crop must be True or False, got 'yes'"),
])
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ImageTransform(**kwargs)


def test_defaults_are_torchvisions():
    t = ImageTransform(scale=[0.08, 1], ratio=[3 / 4, 4 / 3])
    assert t == ImageTransform()
    assert (t.size, t.scale, t.ratio, t.random_crop, t.flip) == (
        224, (0.08, 1.0), (0.75, 4 / 3), True, True)


def test_transform_pickles_and_hashes():
    import pickle

    t = ImageTransform(size=96, random_crop=False, resize=110, interpolation="cubic")
    assert pickle.loads(pickle.dumps(t)) == t
    assert hash(t) == hash(ImageTransform(size=96, random_crop=False, resize=110,
                                          interpolation="cubic"))


def test_cv2_goes_single_threaded_on_first_batch_only(monkeypatch):
    import raying.image.transform as transforms_module

    calls = []
    monkeypatch.setattr(transforms_module, "_cv2_single_threaded", False)
    monkeypatch.setattr(transforms_module.cv2, "setNumThreads", calls.append)
    t = ImageTransform(size=8)
    for _ in range(3):
        t.apply_decoded(np.zeros((2, 10, 10, 3), np.uint8), [0, 1], seed=0, epoch=0)
    assert calls == [1]


@pytest.mark.parametrize("interpolation", ["linear", "cubic", "nearest"])
def test_interpolations(interpolation):
    img = _smooth(90, 120)
    t = ImageTransform(size=40, interpolation=interpolation)
    got = t.apply_decoded([img] * 4, np.arange(4), seed=0, epoch=0)
    ref = ImageTransform(size=40).apply_decoded([img] * 4, np.arange(4), seed=0, epoch=0)
    assert got.shape == (4, 40, 40, 3)
    assert np.abs(got.astype(int) - ref).mean() < 3.0


# --- randomness ---------------------------------------------------------------------------------


def test_uniforms_are_counter_based():
    ids = np.array([5, 0, 99, 7], dtype=np.int64)
    u = _rng.uniforms(3, 2, ids, 6)
    assert u.shape == (4, 6) and u.min() >= 0.0 and u.max() < 1.0
    for row, i in zip(u, ids, strict=True):
        np.testing.assert_array_equal(row, _rng.uniforms(3, 2, [i], 6)[0])
    assert not np.array_equal(u, _rng.uniforms(3, 3, ids, 6))
    assert not np.array_equal(u, _rng.uniforms(4, 2, ids, 6))
    big = _rng.uniforms(0, 0, np.arange(200_000), 1).ravel()
    assert abs(big.mean() - 0.5) < 0.005 and abs(big.var() - 1 / 12) < 0.002
    assert np.abs(np.corrcoef(big[:-1], big[1:])[0, 1]) < 0.01


def test_crop_boxes_inside_and_in_range():
    t = ImageTransform()
    rng = np.random.default_rng(0)
    n = 20_000
    heights = rng.integers(1, 1200, n)
    widths = rng.integers(1, 1200, n)
    boxes, flips = t.crop_params(heights, widths, np.arange(n), seed=1, epoch=0)
    top, left, h, w = boxes.T
    assert boxes.dtype == np.int64 and flips.dtype == bool
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= heights).all() and (left + w <= widths).all()
    # Where the image is big enough for rounding not to matter, area and ratio are in range.
    big = (heights >= 200) & (widths >= 200)
    frac = (h * w / (heights * widths))[big]
    assert frac.min() >= 0.08 * 0.97 and frac.max() <= 1.0
    ratio = (w / h)[big]
    assert ratio.min() >= 0.75 * 0.97 and ratio.max() <= 4 / 3 * 1.03


def _torchvision_get_params(height, width, scale, ratio, uniform, randint):
    """torchvision's RandomResizedCrop.get_params, line by line, with pluggable randomness."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for attempt in range(10):
        target_area = area * uniform(attempt, scale[0], scale[1])
        aspect_ratio = math.exp(uniform(10 + attempt, log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = randint(20, 0, height - h + 1)
            j = randint(21, 0, width - w + 1)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


@pytest.mark.parametrize(("scale", "ratio"), [((0.08, 1.0), (3 / 4, 4 / 3)),
                                              ((0.5, 1.0), (0.2, 5.0))])
def test_crop_params_equal_a_scalar_port_of_torchvision_on_the_same_draws(scale, ratio):
    t = ImageTransform(scale=scale, ratio=ratio)
    rng = np.random.default_rng(1)
    n = 3000
    heights = rng.integers(1, 700, n)
    widths = rng.integers(1, 700, n)
    ids = np.arange(n) * 7
    boxes, _ = t.crop_params(heights, widths, ids, seed=9, epoch=1)
    draws = _rng.uniforms(9, 1, ids, 23)
    for k in range(n):
        u = draws[k]
        ref = _torchvision_get_params(
            int(heights[k]), int(widths[k]), scale, ratio,
            lambda c, a, b, u=u: a + u[c] * (b - a),
            lambda c, a, b, u=u: a + int(math.floor(u[c] * (b - a))))
        assert tuple(boxes[k]) == ref, (k, heights[k], widths[k])


@pytest.mark.parametrize("hw", [(1000, 1000), (375, 500), (64, 300)])
def test_crop_distribution_matches_torchvision(hw):
    import random

    n = 20_000
    t = ImageTransform()
    boxes, _ = t.crop_params(np.full(n, hw[0]), np.full(n, hw[1]), np.arange(n), seed=0,
                             epoch=0)
    rnd = random.Random(0)
    ref = np.array([_torchvision_get_params(
        hw[0], hw[1], t.scale, t.ratio, lambda c, a, b: rnd.uniform(a, b),
        lambda c, a, b: rnd.randrange(a, b)) for _ in range(n)])
    for got in (boxes, ref):
        assert ((got[:, 0] + got[:, 2]) <= hw[0]).all()
    frac, ref_frac = (b[:, 2] * b[:, 3] / (hw[0] * hw[1]) for b in (boxes, ref))
    assert abs(frac.mean() - ref_frac.mean()) < 0.012  # ~4 standard errors
    lr, ref_lr = (np.log(b[:, 3] / b[:, 2]) for b in (boxes, ref))
    assert abs(lr.mean() - ref_lr.mean()) < 0.012
    assert abs(boxes[:, 0].mean() - ref[:, 0].mean()) < 0.05 * hw[0]


def test_custom_scale_and_ratio_are_respected():
    t = ImageTransform(scale=(0.5, 0.6), ratio=(1.0, 1.0))
    boxes, _ = t.crop_params(np.full(500, 800), np.full(500, 800), np.arange(500), seed=0,
                             epoch=0)
    frac = boxes[:, 2] * boxes[:, 3] / 640_000
    assert frac.min() >= 0.5 * 0.99 and frac.max() <= 0.6 * 1.01
    assert (boxes[:, 2] == boxes[:, 3]).all()


@pytest.mark.parametrize(("hw", "box"), [
    ((10, 1000), (0, 493, 10, 13)),  # too wide: h kept, w = round(10 * 4/3)
    ((1000, 10), (493, 0, 13, 10)),  # too tall: w kept, h = round(10 / (3/4))
])
def test_fallback_is_ratio_clamped_centre_crop(hw, box):
    t = ImageTransform()
    boxes, _ = t.crop_params([hw[0]] * 50, [hw[1]] * 50, np.arange(50), seed=0, epoch=0)
    assert (boxes == np.array(box)).all()


def test_fallback_clamps_ratio_or_takes_the_whole_image():
    t = ImageTransform(scale=(0.99, 1.0), ratio=(0.5, 0.5))  # every attempt too tall
    boxes, _ = t.crop_params([100], [60], [0], seed=0, epoch=0)  # in_ratio 0.6 > 0.5
    assert tuple(boxes[0]) == (0, 5, 100, 50)
    t = ImageTransform(scale=(1.0, 1.0), ratio=(0.5, 2.0))  # full area fits only at ratio 1
    boxes, _ = t.crop_params([100] * 20 + [1], [100] * 20 + [1], np.arange(21), seed=0,
                             epoch=0)
    assert (boxes == np.array([0, 0, 100, 100])).all(axis=1)[:20].all()
    assert tuple(boxes[20]) == (0, 0, 1, 1)


def test_flip_is_fair():
    n = 10_000
    _, flips = ImageTransform().crop_params(np.full(n, 64), np.full(n, 64), np.arange(n),
                                            seed=7, epoch=3)
    # Binomial(10000, 0.5): sd 50; 4 sd is a 6e-5 false-alarm rate, and the seed is fixed.
    assert abs(int(flips.sum()) - n // 2) < 200
    _, none = ImageTransform(flip=False).crop_params([64], [64], [0], seed=7, epoch=3)
    assert not none.any()


def test_crop_params_validates():
    t = ImageTransform()
    with pytest.raises(ConfigError, match="same length, got 2, 2 and 1"):
        t.crop_params([5, 5], [5, 5], [0], seed=0, epoch=0)
    with pytest.raises(ConfigError, match="must be positive"):
        t.crop_params([0], [5], [0], seed=0, epoch=0)


# --- batch API ----------------------------------------------------------------------------------


def test_apply_encoded_shape_dtype_and_out():
    datas = _jpegs(6, 96, 128)
    t = ImageTransform(size=32)
    res = t.apply_encoded(datas, np.arange(6), seed=0, epoch=0)
    assert isinstance(res, TransformResult)
    assert res.images.shape == (6, 32, 32, 3) and res.images.dtype == np.uint8
    assert res.images.flags.c_contiguous and res.ok.all() and res.errors == []
    out = np.zeros((8, 32, 32, 3), np.uint8)
    again = t.apply_encoded(datas, np.arange(6), seed=0, epoch=0, out=out)
    assert np.shares_memory(again.images, out)
    np.testing.assert_array_equal(again.images, res.images)
    with pytest.raises(ConfigError, match=r"out must be a writable C-contiguous uint8 array"):
        t.apply_encoded(datas, np.arange(6), seed=0, epoch=0, out=np.zeros((5, 32, 32, 3)))
    with pytest.raises(ConfigError, match="got 6 images but 5 ids"):
        t.apply_encoded(datas, np.arange(5), seed=0, epoch=0)


def test_same_seed_epoch_id_same_pixels_whatever_the_grouping():
    datas = _jpegs(10, 120, 160)
    ids = np.arange(100, 110)
    t = ImageTransform(size=48)
    whole = t.apply_encoded(datas, ids, seed=5, epoch=2).images
    np.testing.assert_array_equal(whole, t.apply_encoded(datas, ids, seed=5, epoch=2).images)
    parts = [t.apply_encoded(datas[a:b], ids[a:b], seed=5, epoch=2).images
             for a, b in ((0, 3), (3, 4), (4, 10))]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    order = np.arange(10)[::-1]
    rev = t.apply_encoded([datas[i] for i in order], ids[order], seed=5, epoch=2).images
    np.testing.assert_array_equal(whole, rev[::-1])
    other = t.apply_encoded(datas, ids, seed=5, epoch=3).images
    assert sum(not np.array_equal(a, b) for a, b in zip(whole, other, strict=True)) >= 8


def test_different_epochs_give_different_crops():
    t = ImageTransform()
    ids = np.arange(1000)
    b0, _ = t.crop_params(np.full(1000, 375), np.full(1000, 500), ids, seed=0, epoch=0)
    b1, _ = t.crop_params(np.full(1000, 375), np.full(1000, 500), ids, seed=0, epoch=1)
    assert (b0 != b1).any(axis=1).mean() > 0.99


def test_good_samples_never_lost_next_to_bad_ones(corpus):
    cases = list(corpus.cases)
    datas = [(corpus.root / c.path).read_bytes() for c in cases] + [None]
    ids = np.arange(len(datas)) * 10 + 3
    t = ImageTransform(size=40)
    res = t.apply_encoded(datas, ids, seed=11, epoch=4, max_pixels=corpus.max_pixels)
    expected_ok = np.array([c.good for c in cases] + [False])
    np.testing.assert_array_equal(res.ok, expected_ok)
    assert len(res.images) == expected_ok.sum()
    reasons = [c.reason for c in cases if not c.good] + ["missing"]
    assert [e.reason for e in res.errors] == reasons
    assert [e.sample_id for e in res.errors] == list(ids[~expected_ok])
    # Each good image is exactly what it is on its own, and matches the decoded path.
    good_pos = np.flatnonzero(expected_ok)
    for row, pos in enumerate(good_pos):
        alone = t.apply_encoded([datas[pos]], ids[pos:pos + 1], seed=11, epoch=4)
        np.testing.assert_array_equal(res.images[row], alone.images[0], err_msg=cases[pos].path)
        ref = t.apply_decoded([decode_image(datas[pos])], ids[pos:pos + 1], seed=11, epoch=4)
        diff = np.abs(res.images[row].astype(int) - ref[0]).mean()
        assert diff < 1.5, (cases[pos].path, diff)


def test_empty_batches():
    t = ImageTransform(size=8)
    res = t.apply_encoded([], [], seed=0, epoch=0)
    assert res.images.shape == (0, 8, 8, 3) and res.ok.shape == (0,) and res.errors == []
    assert t.apply_decoded(np.zeros((0, 5, 5, 3), np.uint8), [], seed=0, epoch=0).shape == (
        0, 8, 8, 3)


def test_bad_input_reports_do_not_raise():
    t = ImageTransform(size=16)
    res = t.apply_encoded([b"", None, b"junk", np.zeros(3, np.float64)], [1, 2, 3, 4],
                          seed=0, epoch=0)
    assert not res.ok.any() and res.images.shape == (0, 16, 16, 3)
    assert [(e.reason, e.sample_id) for e in res.errors] == [
        ("empty", 1), ("missing", 2), ("not_an_image", 3), ("unsupported", 4)]
    assert all(isinstance(e, DecodeError) for e in res.errors)


def test_apply_decoded_matches_array_and_list_inputs():
    imgs = np.stack([_smooth(60, 80, i) for i in range(5)])
    t = ImageTransform(size=32)
    a = t.apply_decoded(imgs, np.arange(5), seed=1, epoch=1)
    b = t.apply_decoded(list(imgs), np.arange(5), seed=1, epoch=1)
    assert a.shape == (5, 32, 32, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    gray = t.apply_decoded([imgs[0][..., 0]], [0], seed=1, epoch=1)
    np.testing.assert_array_equal(gray[0, ..., 0], gray[0, ..., 2])
    rgba = np.concatenate([imgs[:1], np.zeros((1, 60, 80, 1), np.uint8)], axis=3)
    np.testing.assert_array_equal(t.apply_decoded(rgba, [0], seed=1, epoch=1), a[:1])
    with pytest.raises(ConfigError, match="decoded images must be"):
        t.apply_decoded([imgs[0].astype(np.float32)], [0], seed=1, epoch=1)


def test_apply_encoded_crops_items_given_decoded_with_the_same_draws():
    """Decoded-cache hits go through apply_encoded beside encoded misses: an item given as a
    decoded array is rendered as apply_decoded renders it, an encoded one as alone, a bad
    one is reported, all in input order; the time spent on the decoded ones is reported."""
    datas = _jpegs(6, 120, 160)
    ids = np.arange(40, 46)
    t = ImageTransform(size=48)
    arrays = [decode_image(d) for d in datas]
    mixed = [arrays[0], datas[1], b"not an image", arrays[3], datas[4], arrays[5]]
    res = t.apply_encoded(mixed, ids, seed=3, epoch=1)
    assert res.ok.tolist() == [True, True, False, True, True, True]
    assert [e.sample_id for e in res.errors] == [42]
    keep = [0, 1, 3, 4, 5]
    cropped = t.apply_decoded([arrays[i] for i in (0, 3, 5)], ids[[0, 3, 5]], seed=3, epoch=1)
    decoded = t.apply_encoded([datas[i] for i in (1, 4)], ids[[1, 4]], seed=3, epoch=1)
    np.testing.assert_array_equal(res.images[[0, 2, 4]], cropped)
    np.testing.assert_array_equal(res.images[[1, 3]], decoded.images)
    assert res.images.shape[0] == len(keep)
    assert res.decoded_s > 0 and decoded.decoded_s == 0.0
    # At full scale the crop of a decoded image equals the region decode's exactly.
    whole = t.apply_encoded(datas, ids, seed=3, epoch=1)
    assert decoded.decoded_s == 0.0 and whole.ok.all()
    np.testing.assert_array_equal(t.apply_encoded(arrays, ids, seed=3, epoch=1).images,
                                  t.apply_decoded(arrays, ids, seed=3, epoch=1))


def test_flip_mirrors_the_crop():
    img = _smooth(50, 70)
    ids = np.arange(64)
    flipped = ImageTransform(size=24).apply_decoded([img] * 64, ids, seed=2, epoch=0)
    plain = ImageTransform(size=24, flip=False).apply_decoded([img] * 64, ids, seed=2, epoch=0)
    _, flips = ImageTransform(size=24).crop_params([50] * 64, [70] * 64, ids, seed=2, epoch=0)
    assert 0 < flips.sum() < 64
    for k in range(64):
        ref = plain[k, :, ::-1] if flips[k] else plain[k]
        np.testing.assert_array_equal(flipped[k], ref)


@pytest.mark.parametrize(("h", "w"), [(300, 400), (200, 200), (50, 40), (223, 300),
                                      (90, 120), (1000, 250), (256, 256), (48, 48)])
def test_eval_mode_is_resize_then_centre_crop(h, w):
    """torchvision's Resize(256) then CenterCrop(224), to the sub-pixel: the window is not
    rounded to whole source pixels (that shifted it by up to half a source pixel, up to 9
    levels on an image smaller than 224, which is enlarged)."""
    img = _smooth(h, w)
    t = ImageTransform(size=224, random_crop=False, flip=False, resize=256)
    rh, rw = (256, int(256 * w / h)) if h <= w else (int(256 * h / w), 256)
    resized = cv2.resize(img, (rw, rh), interpolation=cv2.INTER_LINEAR)
    top, left = int(round((rh - 224) / 2)), int(round((rw - 224) / 2))
    ref = resized[top:top + 224, left:left + 224].astype(int)
    got = t.apply_decoded([img], [0], seed=0, epoch=0)[0]
    if h < 4 * 256:  # no 2x reduction before the resample: cv2's bilinear, as the reference
        assert np.abs(got - ref).max() <= 1
    assert np.abs(got - ref).mean() < 0.5
    png = t.apply_encoded([cv2.imencode(".png", img[..., ::-1])[1].tobytes()], [0], seed=0,
                          epoch=0).images[0]
    np.testing.assert_array_equal(png, got)
    # Deterministic and the same for every seed, epoch and id.
    again = t.apply_decoded([img], [9], seed=4, epoch=7)[0]
    np.testing.assert_array_equal(got, again)


def test_the_centre_crop_window_of_a_jpeg_is_its_decoded_image_s():
    """A JPEG's region decode (full scale, or DCT-scaled) samples the sub-pixel window as the
    whole decoded image does (a decoded-cache hit and its miss agree to the pixel)."""
    img = _smooth(333, 500)
    jpeg = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
    whole = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)[..., ::-1].copy()
    for size, resize, interpolation in ((224, 256, "linear"), (64, 80, "linear"),
                                        (224, 256, "cubic"), (64, 80, "cubic")):
        t = ImageTransform(size=size, random_crop=False, flip=True, resize=resize,
                           interpolation=interpolation)
        for k in range(2):  # flipped or not
            want = t.apply_decoded([whole], [k], seed=0, epoch=0)[0]
            full = t.apply_encoded([jpeg], [k], seed=0, epoch=0, scaled=False).images[0]
            np.testing.assert_array_equal(full, want)
            dct = t.apply_encoded([jpeg], [k], seed=0, epoch=0).images[0]
            assert np.abs(dct.astype(int) - want).mean() < 1.5
    boxes, _ = ImageTransform(random_crop=False).crop_params([300], [400], [0], seed=0, epoch=0)
    # resize=size: 300x400 -> 224x298, centre 224x224 at left 37 -> source box 300 x
    # 224*400/298 at left 37*400/298.
    np.testing.assert_allclose(boxes[0], (0, 37 * 400 / 298, 300, 224 * 400 / 298))



def test_scaled_may_be_given_per_image():
    """A sequence of ``scaled`` picks each image's decode (a decoded cache admitting only some
    ids): those given False equal the full-scale pixels, the others the DCT-scaled ones."""
    img = _smooth(480, 640)
    jpeg = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
    t = ImageTransform(size=48, scale=(0.5, 1.0))  # every crop shrinks 4x or more
    ids = np.arange(8)
    full = t.apply_encoded([jpeg] * 8, ids, seed=1, epoch=0, scaled=False).images
    dct = t.apply_encoded([jpeg] * 8, ids, seed=1, epoch=0).images
    assert not np.array_equal(full, dct)  # the two decodes differ here
    mask = np.array([True, False] * 4)
    mixed = t.apply_encoded([jpeg] * 8, ids, seed=1, epoch=0, scaled=mask).images
    np.testing.assert_array_equal(mixed[mask], dct[mask])
    np.testing.assert_array_equal(mixed[~mask], full[~mask])
    with pytest.raises(ConfigError, match=r"scaled must be one bool or one per image \(8\)"):
        t.apply_encoded([jpeg] * 8, ids, seed=1, epoch=0, scaled=[True] * 3)

def test_dct_downscale_path_matches_full_decode(monkeypatch):
    """Decoding a whole JPEG at 1/2-1/8 scale before the crop gives nearly the same pixels
    (the region decode off: it does not go through simplejpeg)."""
    from raying.options import Settings, use

    monkeypatch.setattr("raying.options._active", None)  # restored after the test
    use(Settings(roi_decode=0))
    datas = _jpegs(24, 480, 640, quality=95)
    ids = np.arange(24)
    t = ImageTransform(size=64)
    shapes = []
    real = simplejpeg.decode_jpeg

    def spy(*args, **kwargs):
        arr = real(*args, **kwargs)
        shapes.append(arr.shape[:2])
        return arr

    import raying.image.decode as decode_module

    decode_module.simplejpeg.decode_jpeg = spy
    try:
        fast = t.apply_encoded(datas, ids, seed=3, epoch=0).images
    finally:
        decode_module.simplejpeg.decode_jpeg = real
    assert sum(s != (480, 640) for s in shapes) >= 20  # the scaled path was taken
    full = t.apply_decoded([decode_image(d) for d in datas], ids, seed=3, epoch=0)
    diff = np.abs(fast.astype(int) - full).mean(axis=(1, 2, 3))
    assert diff.max() < 1.5, diff
    naive = []
    boxes, flips = t.crop_params([480] * 24, [640] * 24, ids, seed=3, epoch=0)
    for d, (top, left, h, w), flip in zip(datas, boxes, flips, strict=True):
        img = cv2.resize(simplejpeg.decode_jpeg(d)[top:top + h, left:left + w], (64, 64),
                         interpolation=cv2.INTER_AREA)
        naive.append(img[:, ::-1] if flip else img)
    assert np.abs(fast.astype(int) - np.stack(naive)).mean() < 3.0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_rotated_jpeg_crops_the_upright_image(orientation):
    upright = _smooth(120, 72)
    stored = {1: upright, 2: upright[:, ::-1], 3: upright[::-1, ::-1], 4: upright[::-1],
              5: upright.transpose(1, 0, 2), 6: np.rot90(upright, 1),
              7: np.rot90(upright, 2).transpose(1, 0, 2), 8: np.rot90(upright, -1)}[orientation]
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(np.ascontiguousarray(stored)).save(buf, "JPEG", quality=95,
                                                       exif=exif.tobytes())
    assert decode_image(buf.getvalue()).shape == upright.shape
    for size in (32, 8):  # 8: crops of >= 16 px take the DCT-scaled path
        t = ImageTransform(size=size)
        ids = np.arange(16)
        got = t.apply_encoded([buf.getvalue()] * 16, ids, seed=0, epoch=0).images
        ref = t.apply_decoded([upright] * 16, ids, seed=0, epoch=0)
        assert np.abs(got.astype(int) - ref).mean() < 2.0, size


@pytest.mark.parametrize("orientation", [1, 6])
def test_full_scale_decode_equals_cropping_the_decoded_image(corpus, orientation):
    """``scaled=False`` (a decoded cache's misses) gives exactly apply_decoded's pixels of the
    whole decoded image, where the default DCT-scaled decode may differ: crops from 1/8 to
    all of the image, upright and EXIF-turned files, and the corpus's other good images."""
    stored = _smooth(360, 480, 7)
    if orientation == 6:
        stored = np.rot90(stored, 1)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(np.ascontiguousarray(stored)).save(buf, "JPEG", quality=90,
                                                       exif=exif.tobytes())
    upright = decode_image(buf.getvalue())
    ids = np.arange(64)
    for size in (224, 48):  # 48: most crops would take the DCT-scaled path
        t = ImageTransform(size=size, scale=(0.05, 1.0))
        full = t.apply_encoded([buf.getvalue()] * 64, ids, seed=2, epoch=1, scaled=False)
        ref = t.apply_decoded([upright] * 64, ids, seed=2, epoch=1)
        np.testing.assert_array_equal(full.images, ref)
    goods = [(corpus.root / c.path).read_bytes() for c in corpus.good]
    t = ImageTransform(size=24)
    ids = np.arange(len(goods))
    res = t.apply_encoded(goods, ids, seed=0, epoch=0, scaled=False)
    assert res.ok.all()
    np.testing.assert_array_equal(res.images,
                                  t.apply_decoded([decode_image(g) for g in goods], ids,
                                                  seed=0, epoch=0))


@pytest.mark.parametrize("interpolation", ["linear", "cubic"])
def test_region_decode_gives_the_whole_decodes_pixels(monkeypatch, interpolation):
    """A crop rendered from the JPEG region it needs equals the one rendered from the whole
    image: exactly at full scale, within one level after a DCT-scaled decode (the warp's
    fixed-point offsets move with the region's origin)."""
    from raying.image import decode as decode_module
    from raying.options import Settings, use

    if not decode_module.ROI_DECODE:
        pytest.skip("the region-decode extension was not built (no libjpeg headers)")
    monkeypatch.setattr("raying.options._active", None)
    datas = _jpegs(16, 375, 500) + _jpegs(16, 1200, 1500, quality=80)
    ids = np.arange(len(datas))
    calls = []
    real = decode_module._decode_region

    def counting(*args):
        calls.append(args[1])  # the scale in eighths
        return real(*args)

    monkeypatch.setattr(decode_module, "_decode_region", counting)
    out = {}
    for roi in (0, 1):
        use(Settings(roi_decode=roi))
        t = ImageTransform(size=96, interpolation=interpolation)
        out[roi] = t.apply_encoded(datas, ids, seed=4, epoch=2).images.astype(int)
    assert len(calls) == len(datas) and 8 in calls and min(calls) < 8, calls
    full = [i for i, e in enumerate(calls) if e == 8]
    assert np.array_equal(out[0][full], out[1][full])
    assert np.abs(out[0] - out[1]).max() <= 1


def test_tiny_jpegs_give_the_same_pixels_with_or_without_the_region_decode(monkeypatch):
    """Under 8 px two DCT scales give one size (3x3 at 3/8 and 4/8: 2x2); simplejpeg picks
    the smaller, the region decode the asked one: the pixels of one seed and epoch depended
    on which path ran (up to 29 levels apart)."""
    import cv2

    from raying.image import decode as decode_module
    from raying.options import Settings, use

    if not decode_module.ROI_DECODE:
        pytest.skip("the region-decode extension was not built (no libjpeg headers)")
    monkeypatch.setattr("raying.options._active", None)
    rng = np.random.default_rng(0)
    datas = [cv2.imencode(".jpg", rng.integers(0, 255, (h, w, 3), dtype=np.uint8))[1].tobytes()
             for h, w in [(3, 3)] * 6 + [(6, 5), (7, 2), (2, 7), (5, 6)]]
    out = {}
    for roi in (0, 1):
        use(Settings(roi_decode=roi))
        out[roi] = ImageTransform(size=1, flip=False).apply_encoded(
            datas, np.arange(len(datas)), seed=0, epoch=0).images
    assert np.array_equal(out[0], out[1])


def test_odd_sized_crops_keep_their_last_rows_and_columns_when_halved():
    """A crop of 2x the output or more is halved by 2x2 area steps; an odd side's last row or
    column was dropped, and the output's last row/column then sampled the replicated border
    (up to 19 levels off PIL's resize of the crop, the interior 2)."""
    yy, xx = np.mgrid[0:600, 0:800].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(xx / 37.0), 128 + 100 * np.cos(yy / 29.0),
                    128 + 60 * np.sin((xx + yy) / 53.0)], -1).astype(np.uint8)
    t = ImageTransform(size=64, random_crop=True, flip=False)
    ids = np.arange(120)
    out = t.apply_decoded([img] * len(ids), ids, seed=1, epoch=0).astype(int)
    boxes, _ = t.crop_params(np.full(len(ids), 600), np.full(len(ids), 800), ids, seed=1,
                             epoch=0)
    odd = 0
    for got, (top, left, h, w) in zip(out, boxes, strict=True):
        if min(h, w) < 128:
            continue  # not halved
        odd += bool(h % 2 or w % 2)
        ref = np.asarray(Image.fromarray(img[top:top + h, left:left + w]).resize(
            (64, 64), Image.BILINEAR)).astype(int)
        assert np.abs(got - ref).max() <= 5, (top, left, h, w)
    assert odd >= 20


def test_a_crop_far_larger_than_the_output_is_reduced_before_the_resample():
    """Beyond the 1/8-scale decode the crop keeps halving (area steps) until the last
    resample shrinks by less than 2x: a 2048 px crop into 32 px resampled 8x with bilinear
    aliased stripes above the output's Nyquist rate into a false pattern (std 30 against
    PIL's antialiased 1)."""
    period = 22
    stripes = ((np.arange(2048) // (period // 2)) % 2 * 255).astype(np.uint8)
    img = np.repeat(np.repeat(stripes[None, :, None], 2048, 0), 3, 2)
    t = ImageTransform(size=32, random_crop=False, flip=False)
    ids = np.arange(1)
    ref = np.asarray(Image.fromarray(img).resize((32, 32), Image.BILINEAR)).astype(float)
    for out in (t.apply_decoded([img], ids, seed=0, epoch=0),
                t.apply_encoded([simplejpeg.encode_jpeg(img, quality=95)], ids, seed=0,
                                epoch=0).images):
        assert out[0].astype(float).std() < ref.std() + 4


@pytest.mark.parametrize("flip", [False, True])
def test_crops_far_larger_than_the_output_agree_on_every_path(monkeypatch, flip):
    """Past the 1/8-scale decode the halvings must take the same 2x2 pixels on every path:
    from the region decode as from the whole image (a region off the image's grid differed
    by up to 75 levels), the decoded image as the JPEG (up to 16), and a decoded-cache hit
    as its miss (exactly)."""
    from raying.image import decode as decode_module
    from raying.options import Settings, use

    monkeypatch.setattr("raying.options._active", None)
    datas = _jpegs(12, 1200, 1500, quality=90)
    ids = np.arange(len(datas))
    t = ImageTransform(size=16, flip=flip)
    decoded = [decode_image(d, max_pixels=None) for d in datas]
    out = {}
    for roi in (0, 1) if decode_module.ROI_DECODE else (0,):
        use(Settings(roi_decode=roi))
        out[roi] = t.apply_encoded(datas, ids, seed=5, epoch=1).images.astype(int)
        miss = t.apply_encoded(datas, ids, seed=5, epoch=1, scaled=False).images
        assert np.array_equal(miss, t.apply_decoded(decoded, ids, seed=5, epoch=1))
    if 1 in out:
        assert np.abs(out[0] - out[1]).max() <= 1
    hit = t.apply_decoded(decoded, ids, seed=5, epoch=1).astype(int)
    assert np.abs(out[0] - hit).max() <= 3
