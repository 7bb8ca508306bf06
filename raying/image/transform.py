"""Batch decode + random-resized-crop + flip: the hot path inside raying's read tasks."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Sequence

import cv2
import numpy as np

from raying.errors import ConfigError, DecodeError
from raying.image import crop as _crop
from raying.image import exif as _exif
from raying.image import rng as _rng
from raying.image.decode import (
    check_max_pixels,
    decode_image,
    decode_jpeg_region_view,
    decode_jpeg_stored,
    decode_pil,
    jpeg_header,
    region_scratch_bytes,
    start_buffer,
)
from raying.options import DEFAULT_MAX_IMAGE_PIXELS

__all__ = ["ImageTransform", "TransformResult"]

DEFAULT_IMAGE_SIZE = 224
# torchvision's RandomResizedCrop defaults.
DEFAULT_CROP_SCALE = (0.08, 1.0)
DEFAULT_CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
DEFAULT_FLIP_PROBABILITY = 0.5
# The final resample never shrinks by 2x or more (see ImageTransform), so no "area" filter.
INTERPOLATIONS = {
    "linear": cv2.INTER_LINEAR,
    "cubic": cv2.INTER_CUBIC,
    "nearest": cv2.INTER_NEAREST,
}

_cv2_single_threaded = False
# Scaled-source pixels kept around a crop's footprint for the warp's interpolation (cubic
# reads 2 beyond), so the warp reads the same source pixels as from the whole image (its
# output within one level: cv2's fixed-point offsets move with the region's origin). A
# region is at most about (2 x size) x (2 x size x 4/3) pixels, unless the crop is over 16x
# the output (then 2x area steps after the 1/8-scale decode take it there): the DCT scaling
# takes larger crops down, and the crop's aspect ratio is bounded.
_REGION_SUPPORT = 3
_scratch = threading.local()  # each thread's buffer for decoded regions


# The most a thread's region buffer keeps between calls: a larger region (a whole-pixel crop
# of a large photo decoded at full scale) gets a buffer of its own, freed with it, so that
# one such photo does not pin its size in every decoding thread of a long-lived worker.
_REGION_BUFFER_KEEP = 32 << 20


def _region_buffer(nbytes: int) -> np.ndarray:
    """This thread's scratch buffer, at least ``nbytes`` long (grown up to a bound)."""
    if nbytes > _REGION_BUFFER_KEEP:
        return np.empty(nbytes, dtype=np.uint8)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf


def _worker_setup() -> None:
    """cv2 to one thread, once per process, on the first batch (not at import).

    Read tasks already run one per core, and cv2's thread pool gains little on 224 px images
    while competing with them for cores. Process-wide: a driver that calls ``apply_*`` itself
    gets it too.
    """
    global _cv2_single_threaded
    if not _cv2_single_threaded:
        cv2.setNumThreads(1)
        _cv2_single_threaded = True


@dataclasses.dataclass(frozen=True, eq=False)
class TransformResult:
    """What :meth:`ImageTransform.apply_encoded` returns for one batch.

    Attributes:
        images: (n_ok, size, size, 3) uint8, the successes only, in input order.
        ok: (n,) bool, which inputs succeeded; ``ids[ok]`` lines up with ``images``.
        errors: one :class:`DecodeError` per failed input, in input order, ``sample_id`` set.
        decoded_s: seconds spent on the inputs given already decoded (only cropped), so a
            caller can tell what a decoded-cache hit costs against a decode.
    """

    images: np.ndarray
    ok: np.ndarray
    errors: list[DecodeError]
    decoded_s: float = 0.0


def _pair(name: str, value) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        msg = f"ImageTransform {name} must be a pair of numbers (min, max), got {value!r}"
        raise ConfigError(msg) from None
    if not (0 < lo <= hi and math.isfinite(hi)):
        msg = f"ImageTransform {name} must satisfy 0 < min <= max < inf, got {value!r}"
        raise ConfigError(msg)
    return lo, hi


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        msg = f"ImageTransform {name} must be a positive integer, got {value!r}"
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """Crop, resize and flip images to ``size`` x ``size`` uint8 RGB, decoding if needed.

    Training (``random_crop=True``) is torchvision's ``RandomResizedCrop(size, scale,
    ratio)`` followed by ``RandomHorizontalFlip()``; evaluation (``random_crop=False``) is
    ``Resize(resize or size)`` then ``CenterCrop(size)``, flipped only if ``flip`` is set.

    Randomness is counter-based: every draw is a hash of ``(seed, epoch, sample id, draw
    index)``, so one epoch gives the same pixels whichever blocks, workers or retries its
    ids go through, and no generator object is built per sample.

    Speed: a JPEG's crop box is drawn from its header alone, then the image is decoded in
    libjpeg-turbo's DCT domain at 1/8, 1/4 or 1/2 scale when the crop still covers ``size``
    pixels, so the final resample never shrinks by 2x or more. Decoded inputs (and non-JPEG
    files) get the same reduction as repeated 2x area averaging, so both paths give nearly
    the same pixels and ``"linear"`` does not alias. The crop is a view; it is resized straight
    into the output slot (``cv2.resize``, then an in-place flip) or, for a reduced or
    EXIF-turned source, resampled there by one sub-pixel exact ``cv2.warpAffine`` that also
    turns and mirrors it. The first ``apply_*`` call in a process sets
    ``cv2.setNumThreads(1)`` (read tasks already run one per core).

    Args:
        size: output height and width in pixels.
        random_crop: random-resized-crop (training) or resize + centre crop (evaluation).
        flip: mirror left-right with probability 0.5.
        scale: range of the crop's area as a fraction of the image (training).
        ratio: range of the crop's aspect ratio, width / height (training).
        resize: shorter side before the centre crop (evaluation); defaults to ``size``.
        interpolation: the final resample's filter: ``"linear"``, ``"cubic"`` or
            ``"nearest"``.
    """

    size: int = DEFAULT_IMAGE_SIZE
    random_crop: bool = True
    flip: bool = True
    scale: tuple[float, float] = DEFAULT_CROP_SCALE
    ratio: tuple[float, float] = DEFAULT_CROP_RATIO
    resize: int | None = None
    interpolation: str = "linear"

    def __post_init__(self) -> None:
        _positive_int("size", self.size)
        if not isinstance(self.random_crop, bool):
            msg = f"ImageTransform random_crop must be True or False, got {self.random_crop!r}"
            raise ConfigError(msg)
        if not isinstance(self.flip, bool):
            msg = f"ImageTransform flip must be True or False, got {self.flip!r}"
            raise ConfigError(msg)
        scale = _pair("scale", self.scale)
        if scale[1] > 1.0:
            msg = ("ImageTransform scale is a fraction of the image area, at most 1.0, got "
                   f"{self.scale!r}")
            raise ConfigError(msg)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", _pair("ratio", self.ratio))
        if self.resize is not None:
            _positive_int("resize", self.resize)
            if self.resize < self.size:
                msg = (f"ImageTransform resize ({self.resize}) must be >= size ({self.size}): "
                       "the centre crop cannot be larger than the resized image")
                raise ConfigError(msg)
        if self.interpolation not in INTERPOLATIONS:
            msg = (f"ImageTransform interpolation must be one of {sorted(INTERPOLATIONS)}, "
                   f"got {self.interpolation!r}")
            raise ConfigError(msg)

    # --- randomness --------------------------------------------------------------------------

    def crop_params(self, heights, widths, ids, *, seed: int,
                    epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Crop boxes and flip flags for images of the given (upright) sizes.

        Args:
            heights: (n,) image heights.
            widths: (n,) image widths.
            ids: (n,) sample ids; each id's draws depend only on (seed, epoch, id).
            seed: the run's seed.
            epoch: the epoch number.

        Returns:
            ``(boxes, flips)``: (n, 4) ``(top, left, height, width)`` inside the image, and
            (n,) bool. Random crops are whole pixels (int64), as torchvision's; the centre
            crop is torchvision's resize-then-crop window on the source, to the sub-pixel
            (float64).
        """
        h = np.asarray(heights, dtype=np.int64).reshape(-1)
        w = np.asarray(widths, dtype=np.int64).reshape(-1)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not len(h) == len(w) == len(ids):
            msg = (f"heights, widths and ids must have the same length, got {len(h)}, "
                   f"{len(w)} and {len(ids)}")
            raise ConfigError(msg)
        if len(h) and (h.min() <= 0 or w.min() <= 0):
            msg = "image heights and widths must be positive"
            raise ConfigError(msg)
        draws = _rng.uniforms(seed, epoch, ids, _crop.N_DRAWS)
        if self.random_crop:
            boxes = _crop.random_resized_boxes(h, w, draws, self.scale, self.ratio)
        else:
            boxes = _crop.center_boxes(h, w, self.size, self.resize or self.size)
        if self.flip:
            flips = draws[:, _crop.DRAW_FLIP] < DEFAULT_FLIP_PROBABILITY
        else:
            flips = np.zeros(len(h), dtype=bool)
        return boxes, flips

    # --- batch API ---------------------------------------------------------------------------

    def apply_encoded(self, datas: Sequence, ids, *, seed: int, epoch: int,
                      max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                      out: np.ndarray | None = None,
                      scaled: bool | Sequence[bool] = True) -> TransformResult:
        """Decode and transform a batch of encoded images; bad ones are reported, not raised.

        Args:
            datas: encoded files (bytes, memoryview, 1-D uint8 arrays) or None for missing;
                an item may also be an image already decoded, an upright (H, W[, C]) uint8
                array (a decoded-cache hit), which is only cropped, with the same draws.
            ids: (n,) sample ids, for the random draws and the errors.
            seed: the run's seed.
            epoch: the epoch number.
            max_pixels: refuse images whose header claims more pixels (None: no limit).
            out: optional (>= n, size, size, 3) uint8 C-contiguous array to write into.
            scaled: let a JPEG decode at a reduced scale (libjpeg's DCT scaling) where the
                crop shrinks; False decodes at full scale (still only the crop's region), so
                every image's pixels equal :meth:`apply_decoded`'s of the whole decoded
                image, as a decoded cache needs: its hits and misses then look the same.
                A sequence gives each image's own (a cache that admits only some ids needs
                full scale for those alone).

        Returns:
            A :class:`TransformResult`; ``images`` is a view of ``out`` when given.
        """
        _worker_setup()
        check_max_pixels(max_pixels)
        n = len(datas)
        ids = self._ids(ids, n)
        out = self._out(out, n)
        bufs: list = [None] * n
        headers: list = [None] * n
        failed: dict[int, DecodeError] = {}
        heights = np.ones(n, dtype=np.int64)
        widths = np.ones(n, dtype=np.int64)
        for i, data in enumerate(datas):
            if isinstance(data, np.ndarray) and data.ndim >= 2:  # already decoded: crop only
                bufs[i] = data
                heights[i], widths[i] = data.shape[0], data.shape[1]
                continue
            try:
                buf = start_buffer(data)
                header = jpeg_header(buf, max_pixels)
            except DecodeError as exc:
                failed[i] = exc
                continue
            bufs[i] = buf
            if header is not None:
                headers[i] = header
                height, width, orientation = header
                if _exif.swaps_axes(orientation):
                    height, width = width, height
                heights[i], widths[i] = height, width
        boxes, flips = self.crop_params(heights, widths, ids, seed=seed, epoch=epoch)
        boxes, flips = _box_list(boxes), flips.tolist()  # Python scalars: cheaper per element
        ok = np.zeros(n, dtype=bool)
        slot = 0
        decoded_s = 0.0
        each_scaled = ([bool(scaled)] * n if np.ndim(scaled) == 0
                       else [bool(v) for v in scaled])
        if len(each_scaled) != n:
            msg = f"scaled must be one bool or one per image ({n}), got {len(each_scaled)}"
            raise ConfigError(msg)
        for i in range(n):
            if i in failed:
                continue
            try:
                if headers[i] is not None:
                    self._render_jpeg(bufs[i], headers[i], boxes[i], flips[i], out[slot],
                                      each_scaled[i])
                elif isinstance(bufs[i], np.ndarray) and bufs[i].ndim >= 2:
                    t0 = time.perf_counter()
                    self._render_array(bufs[i], boxes[i], flips[i], out[slot])
                    decoded_s += time.perf_counter() - t0
                else:
                    arr = decode_pil(bufs[i], max_pixels)
                    box, flip = self.crop_params(arr.shape[0], arr.shape[1], ids[i:i + 1],
                                                 seed=seed, epoch=epoch)
                    self._render_array(arr, _box_list(box)[0], bool(flip[0]), out[slot])
            except DecodeError as exc:
                failed[i] = exc
                continue
            except Exception as exc:  # one bad sample must never take the batch down
                failed[i] = DecodeError("corrupt", f"{type(exc).__name__}: {exc}")
                continue
            ok[i] = True
            slot += 1
        errors = [DecodeError(failed[i].reason, failed[i].detail, path=failed[i].path,
                              sample_id=int(ids[i])) for i in sorted(failed)]
        return TransformResult(images=out[:slot], ok=ok, errors=errors, decoded_s=decoded_s)

    def apply_decoded(self, images, ids, *, seed: int, epoch: int,
                      out: np.ndarray | None = None) -> np.ndarray:
        """Transform already decoded images (same draws as :meth:`apply_encoded`).

        Args:
            images: a sequence of (H, W, C) or (H, W) uint8 arrays with C in 1, 3, 4 (alpha
                is dropped), or one (n, H, W, C) array.
            ids: (n,) sample ids.
            seed: the run's seed.
            epoch: the epoch number.
            out: optional (>= n, size, size, 3) uint8 C-contiguous array to write into.

        Returns:
            (n, size, size, 3) uint8.
        """
        _worker_setup()
        n = len(images)
        ids = self._ids(ids, n)
        out = self._out(out, n)
        if isinstance(images, np.ndarray) and images.ndim == 4:
            heights = np.full(n, images.shape[1], dtype=np.int64)
            widths = np.full(n, images.shape[2], dtype=np.int64)
        else:
            heights = np.array([np.shape(a)[0] for a in images], dtype=np.int64)
            widths = np.array([np.shape(a)[1] if np.ndim(a) >= 2 else 0 for a in images],
                              dtype=np.int64)
        boxes, flips = self.crop_params(heights, widths, ids, seed=seed, epoch=epoch)
        boxes, flips = _box_list(boxes), flips.tolist()
        for i in range(n):
            self._render_array(images[i], boxes[i], flips[i], out[i])
        return out[:n]

    # --- per image ---------------------------------------------------------------------------

    def _ids(self, ids, n: int) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) != n:
            msg = f"got {n} images but {len(ids)} ids; pass one id per image"
            raise ConfigError(msg)
        return ids

    def _out(self, out: np.ndarray | None, n: int) -> np.ndarray:
        size = self.size
        if out is None:
            return np.empty((n, size, size, 3), dtype=np.uint8)
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 4
                or out.shape[0] < n or out.shape[1:] != (size, size, 3)
                or not out.flags.c_contiguous or not out.flags.writeable):
            got = (f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray)
                   else type(out).__name__)
            msg = (f"out must be a writable C-contiguous uint8 array of shape "
                   f"(>= {n}, {size}, {size}, 3), got {got}")
            raise ConfigError(msg)
        return out

    def _render_jpeg(self, buf, header, box, flip, dst: np.ndarray, scaled: bool = True
                     ) -> None:
        """Decode only as much resolution, and only the region, the crop needs, then
        resample into dst (the whole image's pixels at full scale; within one level after a
        DCT-scaled decode). ``scaled=False``: full scale, rendered as :meth:`_render_array`
        renders the whole decoded image."""
        height, width, orientation = header
        if not scaled:
            if orientation == 1 and self._render_jpeg_region(buf, height, width, 8, box, flip,
                                                             dst, as_array=True):
                return
            self._render_array(decode_image(buf, max_pixels=None), box, flip, dst)
            return
        halvings = _crop.halvings(box[2], box[3], self.size)
        eighths = 8 >> min(halvings, 3)  # libjpeg's DCT scaling does the first three
        tiny = max(height, width) < 8
        if tiny:
            # Under 8 px another n/8 scale gives the same size (3x3 at 3/8 and at 4/8 is
            # 2x2), and simplejpeg picks the smallest: a tiny image decodes whole, at full
            # scale, then halves, whichever path would have run.
            eighths = 8
        extra = halvings - {8: 0, 4: 1, 2: 2, 1: 3}[eighths]
        if orientation == 1 and not tiny and self._render_jpeg_region(
                buf, height, width, eighths, box, flip, dst, extra=extra):
            return
        src = decode_jpeg_stored(buf, height, width, eighths)
        if eighths == 8 and orientation == 1 and _whole(box):
            self._resize(src, box, flip, dst)
            return
        # libjpeg's n/8 scaled IDCT maps full-size pixel edges exactly by n/8.
        matrix = _crop.inverse_map(box, flip, self.size, orientation, height, width, eighths / 8)
        self._warp(*_halved(src, matrix, extra), dst)

    def _render_jpeg_region(self, buf, height: int, width: int, eighths: int, box, flip,
                            dst: np.ndarray, as_array: bool = False, extra: int = 0) -> bool:
        """The crop's region of an upright JPEG, decoded alone (decode_jpeg_region_view) and
        resampled into dst; False when the region decode declined. ``as_array`` (full scale
        only) resamples the region as :meth:`_render_array` does a whole image's crop."""
        top, left, box_h, box_w = box
        whole = _whole(box)
        # Halvings after the decode take 2x2 pixels on the whole image's grid, as a decoded
        # image's do: the region starts on it (and, halved here, takes the support it needs).
        step = 1 << (_crop.halvings(box_h, box_w, self.size) if as_array else extra)
        sh, sw = -(-height * eighths // 8), -(-width * eighths // 8)
        if eighths == 8 and whole:  # whole pixels: the crop itself, resized
            y0, x0, y1, x1 = top, left, top + box_h, left + box_w
        else:  # the crop's scaled footprint and the resampler's support around it
            y0, x0, y1, x1 = _support_window(box, eighths / 8, sh, sw,
                                             _REGION_SUPPORT * (1 if as_array else step))
        y0, x0 = y0 - y0 % step, x0 - x0 % step
        y1, x1 = min(sh, -(-y1 // step) * step), min(sw, -(-x1 // step) * step)
        rh, rw = y1 - y0, x1 - x0
        src = decode_jpeg_region_view(buf, eighths, y0, x0, rh, rw,
                                      _region_buffer(region_scratch_bytes(rh, rw)))
        if src is None:
            return False
        if as_array:
            self._render_array(src, (top - y0, left - x0, box_h, box_w), flip, dst)
            return True
        if eighths == 8 and whole:  # (no halving here: step is 1)
            self._resize(src, (0, 0, box_h, box_w), flip, dst)
            return True
        matrix = _crop.inverse_map(box, flip, self.size, 1, height, width, eighths / 8)
        matrix[0, 2] -= x0  # the region's origin in the scaled image
        matrix[1, 2] -= y0
        self._warp(*_halved(src, matrix, extra), dst)
        return True

    def _render_array(self, arr: np.ndarray, box, flip, dst: np.ndarray) -> None:
        """Crop (a view), reduce by 2x area steps like the JPEG path, resample into dst."""
        arr = np.asarray(arr)
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (
                arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
            msg = (f"decoded images must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) uint8, "
                   f"got {arr.dtype} {arr.shape}")
            raise ConfigError(msg)
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[..., 0]
        top, left, box_h, box_w = box
        halvings = _crop.halvings(box_h, box_w, self.size)
        if not halvings:
            if _whole(box):
                self._resize(arr, box, flip, dst)
                return
            # A sub-pixel box (the centre crop), sampled in place with its edges blended, from
            # the window the region decode gives a JPEG (the box and the resampler's support
            # around it): a decoded-cache hit (the whole image) and its miss (that region)
            # then call the warp alike, as cubic's fixed-point offsets need for equal pixels.
            y0, x0, y1, x1 = _support_window(box, 1.0, arr.shape[0], arr.shape[1])
            matrix = _crop.inverse_map((top - y0, left - x0, box_h, box_w), flip, self.size, 1,
                                       0, 0, 1.0)
            self._warp(arr[y0:y1, x0:x1], matrix, dst)
            return
        # Halve the crop until the final resample shrinks by less than 2x, as the JPEG path's
        # DCT scaling does: INTER_AREA on exact halves is a cheap, alias-free box filter. A
        # sub-pixel box is halved from the whole pixels that hold it.
        step = 1 << halvings  # halved on the image's own 2x2 grid, as the JPEG path is
        y0, x0 = int(math.floor(top)), int(math.floor(left))
        y0, x0 = y0 - y0 % step, x0 - x0 % step
        y1, x1 = int(math.ceil(top + box_h)), int(math.ceil(left + box_w))
        y1 = min(arr.shape[0], -(-y1 // step) * step)  # whole pairs up to the image's edge
        x1 = min(arr.shape[1], -(-x1 // step) * step)
        matrix = _crop.inverse_map((top - y0, left - x0, box_h, box_w), flip, self.size, 1,
                                   0, 0, 1.0)
        self._warp(*_halved(arr[y0:y1, x0:x1], matrix, halvings), dst)

    def _resize(self, src: np.ndarray, box, flip, dst: np.ndarray) -> None:
        """Whole-pixel crop (a view) resized into dst, then mirrored in place.

        For upright full-size sources this is exact and, upsampling, 2x cheaper than a warp.
        """
        top, left, box_h, box_w = box
        view = _cv2_ready(src[top:top + box_h, left:left + box_w])
        size = (self.size, self.size)
        interp = INTERPOLATIONS[self.interpolation]
        if view.ndim == 3 and view.shape[2] == 3:
            cv2.resize(view, size, dst=dst, interpolation=interp)
        else:
            _to_rgb(cv2.resize(view, size, interpolation=interp), dst)
        if flip:
            cv2.flip(dst, 1, dst=dst)

    def _warp(self, src: np.ndarray, matrix: np.ndarray, dst: np.ndarray) -> None:
        """Sub-pixel exact resample into dst: crop, resize, EXIF turn and mirror in one pass."""
        flags = INTERPOLATIONS[self.interpolation] | cv2.WARP_INVERSE_MAP
        size = (self.size, self.size)
        src = _cv2_ready(src)
        if src.ndim == 3 and src.shape[2] == 3:
            cv2.warpAffine(src, matrix, size, dst=dst, flags=flags,
                           borderMode=cv2.BORDER_REPLICATE)
        else:
            _to_rgb(cv2.warpAffine(src, matrix, size, flags=flags,
                                   borderMode=cv2.BORDER_REPLICATE), dst)


def _halve(src: np.ndarray) -> np.ndarray:
    """``src`` at half size by 2x2 area averages; an odd last row or column is averaged with
    itself (edge replicated), as libjpeg's scaled decode treats it, so every output pixel
    covers exactly two input pixels each way and nothing of the crop is dropped."""
    src = _cv2_ready(src)
    h, w = src.shape[:2]
    if h % 2 or w % 2:
        src = cv2.copyMakeBorder(src, 0, h % 2, 0, w % 2, cv2.BORDER_REPLICATE)
    return cv2.resize(src, (src.shape[1] // 2, src.shape[0] // 2),
                      interpolation=cv2.INTER_AREA)


def _halved(src: np.ndarray, matrix: np.ndarray, times: int) -> tuple[np.ndarray, np.ndarray]:
    """``src`` halved ``times`` times, and the warp matrix that samples the halved image where
    ``matrix`` sampled ``src``: pixel centre c becomes (c + 0.5) / 2 - 0.5 at each halving."""
    for _ in range(times):
        src = _halve(src)
        matrix = matrix / 2.0
        matrix[:, 2] -= 0.25
    return src, matrix


def _support_window(box, scale: float, height: int, width: int,
                    support: int = _REGION_SUPPORT) -> tuple[int, int, int, int]:
    """``(y0, x0, y1, x1)``: the pixels of an image scaled by ``scale`` (``height`` x
    ``width``) that hold the crop ``box`` and ``support`` pixels around it for the
    resampler. The region decode reads this window, and a decoded image is warped from the
    same one, so both sample alike."""
    top, left, box_h, box_w = box
    return (max(0, int(top * scale) - support),
            max(0, int(left * scale) - support),
            min(height, int(math.ceil((top + box_h) * scale)) + support),
            min(width, int(math.ceil((left + box_w) * scale)) + support))


def _whole(box) -> bool:
    """Whether a crop box lies on whole pixels (random crops; the centre crop's may not)."""
    return all(isinstance(v, int) for v in box)


def _box_list(boxes: np.ndarray) -> list[list[int | float]]:
    """Boxes as Python numbers: ints where a box lies on whole pixels (slices, the region
    decode and the plain resize take it), floats where it does not (a sub-pixel warp)."""
    boxes = np.asarray(boxes)
    if boxes.dtype.kind in "iu":  # random crops: whole pixels already
        return boxes.tolist()
    return [[int(v) for v in b] if all(float(v).is_integer() for v in b) else b
            for b in boxes.tolist()]


def _cv2_ready(a: np.ndarray) -> np.ndarray:
    """``a`` itself when cv2 can wrap it without a copy (pixels packed, rows may be strided)."""
    item = a.itemsize
    channels = 1 if a.ndim == 2 else a.shape[2]
    if a.strides[-1] == item and (a.ndim == 2 or a.strides[1] == channels * item):
        return a
    return np.ascontiguousarray(a)


def _to_rgb(small: np.ndarray, dst: np.ndarray) -> None:
    """Gray (H, W) or RGBA (H, W, 4) into the RGB dst slot."""
    code = cv2.COLOR_RGBA2RGB if small.ndim == 3 and small.shape[2] == 4 else cv2.COLOR_GRAY2RGB
    cv2.cvtColor(small, code, dst=dst)
