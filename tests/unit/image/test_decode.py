"""Tests of raying.image.decode: the bad-input corpus, EXIF orientation, limits, conversions."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import simplejpeg
from PIL import Image, ImageFile, ImageOps

from raying.errors import ConfigError, DecodeError
from raying.image import exif as _exif
from raying.image.decode import DECODE_ERROR_REASONS, decode_image, decode_image_to, image_size
from raying.options import DEFAULT_MAX_IMAGE_PIXELS
from tests.corpus.images import BOMB_SIDE, make_image_corpus, quadrant_mean


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_image_corpus(tmp_path_factory.mktemp("corpus"), n_good=8, seed=0)


def _read(spec, case) -> bytes:
    return (spec.root / case.path).read_bytes()


def _jpeg(arr: np.ndarray, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=95, **kwargs)
    return buf.getvalue()


def _gradient(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([255 * y // max(h - 1, 1), 255 * x // max(w - 1, 1),
                     np.full_like(y, 128)], axis=2).astype(np.uint8)


def test_corpus_has_at_least_ten_bad_kinds(corpus):
    assert len({c.kind for c in corpus.bad}) >= 10
    assert {c.reason for c in corpus.bad} <= set(DECODE_ERROR_REASONS)
    assert len(corpus.good) >= 8 + 15


def test_corpus_is_deterministic(tmp_path):
    a = make_image_corpus(tmp_path / "a", n_good=4, seed=3)
    b = make_image_corpus(tmp_path / "b", n_good=4, seed=3)
    assert a.cases == b.cases
    for case in a.cases:
        assert _read(a, case) == _read(b, case), case.path


def test_every_good_file_decodes_with_its_content(corpus):
    failures = []
    for case in corpus.good:
        arr = decode_image(_read(corpus, case), max_pixels=corpus.max_pixels)
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3 \
                or not arr.flags.c_contiguous:
            failures.append(f"{case.path}: {arr.dtype} {arr.shape}")
            continue
        if arr.shape[:2] != case.shape:
            failures.append(f"{case.path}: shape {arr.shape[:2]} != {case.shape}")
            continue
        mean = arr.reshape(-1, 3).mean(axis=0)
        if np.abs(mean - case.mean).max() > case.tolerance:
            failures.append(f"{case.path}: mean {mean} != {case.mean}")
        if np.abs(np.array(quadrant_mean(arr)) - case.top_left).max() > case.tolerance:
            failures.append(f"{case.path}: top-left {quadrant_mean(arr)} != {case.top_left}")
    assert not failures, failures


def test_every_bad_file_fails_with_its_reason(corpus):
    failures = []
    for case in corpus.bad:
        try:
            decode_image(_read(corpus, case), max_pixels=corpus.max_pixels)
        except DecodeError as exc:
            if exc.reason != case.reason:
                failures.append(f"{case.path}: {exc.reason} != {case.reason} ({exc})")
        else:
            failures.append(f"{case.path}: decoded, expected {case.reason}")
    assert not failures, failures


def test_image_size_matches_decoded_shape(corpus):
    for case in corpus.good:
        assert image_size(_read(corpus, case)) == case.shape, case.path


def test_image_size_reads_a_bomb_without_decoding(corpus):
    case = next(c for c in corpus.bad if c.kind == "decompression_bomb_png")
    assert image_size(_read(corpus, case)) == (BOMB_SIDE, BOMB_SIDE)


def test_default_limit_rejects_the_bomb(corpus):
    if DEFAULT_MAX_IMAGE_PIXELS >= BOMB_SIDE * BOMB_SIDE:
        pytest.skip("RAYING_MAX_IMAGE_PIXELS is set above the bomb's size")
    case = next(c for c in corpus.bad if c.kind == "decompression_bomb_png")
    with pytest.raises(DecodeError, match="RAYING_MAX_IMAGE_PIXELS or decode_image's max_pixels") as info:
        decode_image(_read(corpus, case))
    assert info.value.reason == "too_large"


def test_too_large_message_names_pixels_limit_and_fix():
    data = _jpeg(_gradient(40, 50))
    msg = ("too_large: 40x50 = 2000 pixels is over the limit of 1999 (a decompression bomb?); "
           "raise it with PipelineConfig(max_image_pixels=...), the environment variable "
           "RAYING_MAX_IMAGE_PIXELS or decode_image's max_pixels argument")
    with pytest.raises(DecodeError) as info:
        decode_image(data, max_pixels=1999)
    assert str(info.value) == msg
    assert decode_image(data, max_pixels=2000).shape == (40, 50, 3)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "10"])
def test_max_pixels_is_validated(bad):
    with pytest.raises(ConfigError, match="max_pixels must be a positive integer or None"):
        decode_image(_jpeg(_gradient(4, 4)), max_pixels=bad)


def test_pil_globals_are_left_alone(corpus, monkeypatch):
    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    for case in corpus.cases:
        try:
            decode_image(_read(corpus, case), max_pixels=corpus.max_pixels)
        except DecodeError:
            pass
    assert (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES) == before
    # A caller's limit above PIL's own: no PIL warning or refusal, and PIL's global unchanged.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    buf = io.BytesIO()
    Image.fromarray(_gradient(30, 40)).save(buf, "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_image(buf.getvalue(), max_pixels=10_000).shape == (30, 40, 3)
    assert Image.MAX_IMAGE_PIXELS == 100


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("cut", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_truncated_jpeg_never_decodes_half_grey(cut, progressive):
    data = _jpeg(_gradient(96, 128), progressive=progressive)
    end = max(3, int(len(data) * cut))
    with pytest.raises(DecodeError) as info:
        decode_image(data[:end])
    assert info.value.reason == "truncated"
    with pytest.raises(DecodeError) as info:
        decode_image(data[:end], min_height=24, min_width=32)  # the DCT-scaled decode too
    assert info.value.reason == "truncated"


def test_empty_and_missing():
    with pytest.raises(DecodeError, match="^empty") as info:
        decode_image(b"")
    assert info.value.reason == "empty"
    with pytest.raises(DecodeError) as info:
        decode_image(None)
    assert info.value.reason == "missing"


def test_accepts_bytes_like_inputs():
    data = _jpeg(_gradient(20, 30))
    ref = decode_image(data)
    for wrapped in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        np.testing.assert_array_equal(decode_image(wrapped), ref)
    with pytest.raises(DecodeError, match="encoded image arrays must be 1-D uint8") as info:
        decode_image(np.zeros((4, 4), np.float32))
    assert info.value.reason == "unsupported"


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pil(orientation):
    stored = _gradient(24, 40)
    stored[:6, :10] = 255  # a marker that any wrong turn moves
    for fmt in ("JPEG", "PNG"):
        buf = io.BytesIO()
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(stored).save(buf, fmt, exif=exif.tobytes())
        data = buf.getvalue()
        ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
        got = decode_image(data)
        assert got.shape == ref.shape, (fmt, orientation)
        assert np.abs(got.astype(int) - ref).mean() < 1.0, (fmt, orientation)
        assert image_size(data) == ref.shape[:2]
        if fmt == "JPEG":
            assert _exif.jpeg_orientation(data) == orientation
    # A TIFF's orientation is a tag of its own, and Pillow reports its size upright already.
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(buf, "TIFF", exif=exif.tobytes())
    got = decode_image(buf.getvalue())
    assert image_size(buf.getvalue()) == got.shape[:2]
    assert got.shape[:2] == ((40, 24) if orientation >= 5 else (24, 40))


_XMP = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/'
        b'22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
        b'%s/></rdf:RDF></x:xmpmeta>')


@pytest.mark.parametrize(("xmp", "exif", "want"), [
    (b'tiff:Orientation="6"', None, 6),  # XMP alone: turned, as PIL turns it
    (b'tiff:Orientation="3"', 1, 1),  # an EXIF tag decides over XMP
    (b'tiff:Orientation="8"', 9, 1),  # ... even an invalid one (PIL turns nothing)
    (b'tiff:Orientation="0"', None, 1),
    (b'tiff:Make="x"', None, 1),
])
def test_an_xmp_orientation_counts_where_exif_has_none_as_pil_s(xmp, exif, want):
    stored = _gradient(24, 40)
    stored[:6, :10] = 255  # a marker that any wrong turn moves
    for mode in ("RGB", "CMYK"):  # CMYK decodes through PIL, RGB through simplejpeg
        buf = io.BytesIO()
        kwargs = {"xmp": _XMP % xmp}
        if exif is not None:
            tags = Image.Exif()
            tags[0x0112] = exif
            kwargs["exif"] = tags.tobytes()
        Image.fromarray(stored).convert(mode).save(buf, "JPEG", quality=95, **kwargs)
        data = buf.getvalue()
        ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
        got = decode_image(data)
        assert got.shape == ref.shape, (mode, xmp, exif)
        assert np.abs(got.astype(int) - ref).mean() < 2.0, (mode, xmp, exif)
        assert image_size(data) == ref.shape[:2]
        if mode == "RGB":
            assert _exif.jpeg_orientation(data) == want


def test_exif_40x20_orientation_6_decodes_to_20x40():
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 20), (10, 200, 30)).save(buf, "JPEG", exif=exif.tobytes())
    assert decode_image(buf.getvalue()).shape == (40, 20, 3)  # PIL size (20, 40)


@pytest.mark.parametrize("junk", [b"", b"Exif\0\0", b"Exif\0\0II*\0\xff\xff\xff\xff",
                                  b"Exif\0\0MM\0*\0\0\0\x08\x00\x05\x01\x12"])
def test_malformed_exif_is_ignored(junk):
    data = _jpeg(_gradient(16, 24))
    segment = b"\xff\xe1" + (len(junk) + 2).to_bytes(2, "big") + junk
    broken = data[:2] + segment + data[2:]
    assert _exif.jpeg_orientation(broken) == 1
    assert decode_image(broken).shape == (16, 24, 3)


def test_jpeg_dct_downscale_honours_minimums():
    data = simplejpeg.encode_jpeg(_gradient(256, 320), quality=90)
    assert decode_image(data).shape == (256, 320, 3)
    assert decode_image(data, min_height=64, min_width=64).shape == (64, 80, 3)
    assert decode_image(data, min_height=65).shape == (128, 160, 3)
    assert decode_image(data, min_width=200).shape == (256, 320, 3)
    full = decode_image(data)
    half = decode_image(data, min_height=100, min_width=100)
    import cv2

    ref = cv2.resize(full, (160, 128), interpolation=cv2.INTER_AREA)
    assert np.abs(half.astype(int) - ref).mean() < 2.0


def test_dct_minimums_refer_to_the_upright_image():
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(_gradient(64, 256)).save(buf, "JPEG", exif=exif.tobytes())
    # upright 256x64: min_width=64 allows nothing smaller than the full width
    assert decode_image(buf.getvalue(), min_height=32, min_width=64).shape == (256, 64, 3)
    assert decode_image(buf.getvalue(), min_height=32, min_width=16).shape == (64, 16, 3)


def test_sixteen_bit_png_is_shifted_not_clipped():
    wide = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, "PNG")
    got = decode_image(buf.getvalue())
    np.testing.assert_array_equal(got[..., 0], (wide >> 8).astype(np.uint8))
    np.testing.assert_array_equal(got[..., 0], got[..., 2])


def test_extraneous_bytes_are_tolerated_but_corrupt_data_is_not(corpus):
    data = _jpeg(_gradient(32, 32))
    fine = data[:-2] + b"\x00\x11" + data[-2:]
    assert decode_image(fine).shape == (32, 32, 3)
    case = next(c for c in corpus.bad if c.kind == "corrupt_jpeg")
    with pytest.raises(DecodeError, match="^corrupt: JPEG"):
        decode_image(_read(corpus, case))


def test_decode_image_to_writes_an_upright_jpeg_where_alloc_says():
    from raying.read.cache.arrays import decode_array, new_array_payload

    data = _jpeg(_gradient(30, 50))
    held = {}

    def alloc(shape):
        held["payload"], view = new_array_payload(shape)
        return view

    img, placed = decode_image_to(data, alloc)
    assert placed and img.shape == (30, 50, 3)
    assert np.shares_memory(img, held["payload"])
    assert np.array_equal(img, decode_image(data))
    # The payload is a cache entry as encode_array would write it, pixels included.
    assert np.array_equal(decode_array(memoryview(held["payload"])), decode_image(data))


@pytest.mark.parametrize("kind", ["png", "exif6", "bad"])
def test_decode_image_to_falls_back_without_calling_alloc(kind):
    def alloc(shape):
        raise AssertionError("alloc must not be called")

    buf = io.BytesIO()
    if kind == "png":
        Image.fromarray(_gradient(20, 40)).save(buf, "PNG")
    elif kind == "exif6":
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(_gradient(20, 40)).save(buf, "JPEG", exif=exif.tobytes())
    else:
        buf.write(b"not an image at all")
    data = buf.getvalue()
    if kind == "bad":
        with pytest.raises(DecodeError):
            decode_image_to(data, alloc)
        return
    img, placed = decode_image_to(data, alloc)
    assert not placed and np.array_equal(img, decode_image(data))
    assert img.shape == ((40, 20, 3) if kind == "exif6" else (20, 40, 3))


def _noisy_jpeg(h, w, mode="RGB", **kwargs) -> bytes:
    rng = np.random.default_rng(h * w)
    arr = (np.cumsum(rng.integers(0, 255, (h, w, 3), np.uint8), axis=1) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, "JPEG", quality=85, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["420", "422", "444", "progressive", "gray"])
def test_region_decode_equals_the_whole_decode_at_every_scale(kind):
    """Random regions of JPEGs decoded alone equal the same rows and columns of the whole
    decode, at 1/8 to 8/8 scale, for every chroma layout, progressive and grayscale files."""
    from raying.image import decode as decode_module

    if not decode_module.ROI_DECODE:
        pytest.skip("the region-decode extension was not built (no libjpeg headers)")
    kwargs = {"420": {"subsampling": 2}, "422": {"subsampling": 1}, "444": {"subsampling": 0},
              "progressive": {"progressive": True}, "gray": {}}[kind]
    rng = np.random.default_rng(7)
    checked = 0
    for h, w in [(301, 517), (37, 53), (480, 640)]:
        data = _noisy_jpeg(h, w, "L" if kind == "gray" else "RGB", **kwargs)
        for eighths in (8, 4, 2, 1):
            sh, sw = -(-h * eighths // 8), -(-w * eighths // 8)
            whole = simplejpeg.decode_jpeg(data, "RGB", min_height=sh, min_width=sw)
            assert whole.shape[:2] == (sh, sw)
            for _ in range(6):
                rh, rw = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
                top, left = int(rng.integers(0, sh - rh + 1)), int(rng.integers(0, sw - rw + 1))
                out = np.empty((rh, rw, 3), np.uint8)
                assert decode_module.decode_jpeg_region(memoryview(data), eighths, top, left,
                                                        rh, rw, out)
                assert np.array_equal(out, whole[top:top + rh, left:left + rw]), (
                    eighths, top, left, rh, rw)
                # The copy-free variant: libjpeg's rows in a scratch buffer, the region a view.
                scratch = np.zeros(decode_module.region_scratch_bytes(rh, rw), np.uint8)
                view = decode_module.decode_jpeg_region_view(memoryview(data), eighths, top,
                                                             left, rh, rw, scratch)
                assert view is not None and view.shape == (rh, rw, 3)
                assert np.shares_memory(view, scratch)
                assert np.array_equal(view, out), (eighths, top, left, rh, rw)
                checked += 1
    assert checked == 72


def test_region_decode_declines_what_only_the_whole_decode_can_judge(monkeypatch):
    """A file cut short, one with a stray marker past the region, a region outside the
    image, or RAYING_ROI_DECODE=0: nothing decoded, False, so the caller decodes the whole
    image strictly and reports what is wrong with it."""
    from raying.image import decode as decode_module
    from raying.options import Settings, use
    from tests.corpus.images import _corrupt_jpeg

    if not decode_module.ROI_DECODE:
        pytest.skip("the region-decode extension was not built (no libjpeg headers)")
    data = _noisy_jpeg(240, 320)
    out = np.zeros((8, 8, 3), np.uint8)
    assert decode_module.decode_jpeg_region(memoryview(data), 8, 0, 0, 8, 8, out)
    for bad in (data[:len(data) * 2 // 3], _corrupt_jpeg(data)):
        out[:] = 0
        assert not decode_module.decode_jpeg_region(memoryview(bad), 8, 0, 0, 8, 8, out)
        assert not out.any()
    assert not decode_module.decode_jpeg_region(memoryview(data), 8, 236, 0, 8, 8, out)
    scratch = np.zeros(decode_module.region_scratch_bytes(8, 8), np.uint8)
    for bad in (data[:len(data) * 2 // 3], _corrupt_jpeg(data)):
        assert decode_module.decode_jpeg_region_view(memoryview(bad), 8, 0, 0, 8, 8,
                                                     scratch) is None
    assert decode_module.decode_jpeg_region_view(memoryview(data), 8, 236, 0, 8, 8,
                                                 scratch) is None
    # A scratch too small for libjpeg's rows: declined, nothing written past it.
    small = np.zeros(decode_module.region_scratch_bytes(40, 40), np.uint8)
    assert decode_module.decode_jpeg_region_view(memoryview(data), 8, 100, 100, 60, 200,
                                                 small[:1000]) is None
    assert decode_module.decode_jpeg_region_view(memoryview(data), 8, 0, 0, 8, 8,
                                                 scratch) is not None
    monkeypatch.setattr("raying.options._active", None)
    use(Settings(roi_decode=0))
    assert not decode_module.decode_jpeg_region(memoryview(data), 8, 0, 0, 8, 8, out)
    assert decode_module.decode_jpeg_region_view(memoryview(data), 8, 0, 0, 8, 8,
                                                 scratch) is None
