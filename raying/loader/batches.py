"""Batches from blocks: slicing, a prefetch thread, torch and tf.data conversion.

What is in flight while the trainer holds batch ``b``::

    workers:   decode units u+1 .. u+W          (BlockStream window)
    thread:    slices blocks into batches b+1 .. b+P, converts them to tensors, pins them
               and starts their host->device copies       (P = prefetch_batches)
    trainer:   batch b, already on the device; uint8 -> float and normalization run there

Images stay uint8 NHWC until the device. A batch that lies inside one block is a view of it
(no copy); only batches that straddle blocks are concatenated.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from raying.engine.ray_setup import no_auto_init
from raying.errors import ConfigError
from raying.options import DEFAULT_MEAN, DEFAULT_STD
from raying.read.task import small_pages

_DONE = object()


# Columns of a straddling batch at least this large are joined into reused arrays.
REUSE_MIN_BYTES = 1 << 20
# Reusable arrays kept per (shape, dtype): the batches alive at once (prefetched, held by the
# trainer, being joined) are fewer than this at the default depths; beyond it, fresh arrays.
REUSE_MAX_ARRAYS = 8


class ReusableArrays:
    """Output arrays for the batches that straddle blocks, reused once nothing refers to them.

    A batch that straddles two blocks (a batch size that does not divide the blocks', or
    larger than a block) is joined into a new array. A fresh array of tens of MB costs its
    page faults at every batch (55 ms for 256 rows of 224 px in a driver beside Ray's object
    store, against ~2 ms for the copy into an array already touched), and a batch size of 512
    joins every batch. An array is reused only when nothing else refers to it: the batch that
    held it, a view of it, a torch tensor made from it or a memoryview all count in its
    reference count, so a batch a trainer keeps is never overwritten.
    """

    def __init__(self) -> None:
        # (array, the array its memory belongs to when it is a view, else None)
        # Keyed by the dtype itself: its .str would take structured dtypes of one size
        # (fields named otherwise) for the same, and a join would cast between them.
        self._arrays: dict[tuple[tuple[int, ...], np.dtype],
                           list[tuple[np.ndarray, np.ndarray | None]]] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` nothing else refers to (contents undefined)."""
        dtype = np.dtype(dtype)
        arrays = self._arrays.setdefault((tuple(shape), dtype), [])
        for entry in arrays:
            # Nobody else's: the tuple's reference and getrefcount's argument; a view of the
            # array refers to its memory's owner (numpy collapses view chains), so that
            # one's count (the tuple, the array's own base, the argument) is checked too.
            if sys.getrefcount(entry[0]) <= 2 and (
                    entry[1] is None or sys.getrefcount(entry[1]) <= 3):
                entry[0].flags.writeable = True  # handed out read-only (BatchAssembler)
                return entry[0]
        if dtype == np.uint8:
            # On base-size pages: numpy asks for transparent huge pages on large arrays,
            # and beside Ray's object store the kernel's compaction in their page faults
            # made a fresh 38 MB array cost ~55 ms to fill, ~16 ms on base pages.
            arr = small_pages(tuple(shape))
            owner = arr.base if isinstance(arr.base, np.ndarray) else None
        else:
            arr, owner = np.empty(shape, dtype), None
        if len(arrays) < REUSE_MAX_ARRAYS:
            arrays.append((arr, owner))
        return arr


class BatchAssembler:
    """Cut a stream of blocks into batches of ``batch_size`` rows (the last may be short).

    A batch inside one block is a view of it (read-only: blocks are the object store's); a
    batch that straddles blocks is joined into an array handed out read-only too, so that
    every batch behaves alike whatever the batch size.
    """

    def __init__(self, batch_size: int, *, drop_last: bool = False) -> None:
        if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                or batch_size < 1):
            msg = f"batch_size must be a positive int, got {batch_size!r}"
            raise ConfigError(msg)
        if not isinstance(drop_last, (bool, np.bool_)):
            msg = f"drop_last must be True or False, got {drop_last!r}"
            raise ConfigError(msg)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self._parts: list[dict[str, np.ndarray]] = []
        self._rows = 0
        self._yielded = 0  # batches handed out (a drop_last epoch that gave none warns)
        self._reuse = ReusableArrays()

    def push(self, block: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        n = len(block["id"])
        if n == 0:  # no rows (every sample of it bad): nothing to add, and user stages,
            return  # which run only on rows, did not add their columns to it
        start = 0
        if self._rows:
            take = min(self.batch_size - self._rows, n)
            self._parts.append({k: v[:take] for k, v in block.items()})
            self._rows += take
            start = take
            if self._rows == self.batch_size:
                self._yielded += 1
                yield self._flush()
        while n - start >= self.batch_size:
            self._yielded += 1
            yield _read_only({k: v[start:start + self.batch_size] for k, v in block.items()})
            start += self.batch_size
        if start < n:
            self._parts.append({k: v[start:] for k, v in block.items()})
            self._rows += n - start

    def finish(self) -> Iterator[dict[str, np.ndarray]]:
        if self._rows and not self.drop_last:
            yield self._flush()
        elif self._rows and not self._yielded:
            warnings.warn(
                f"drop_last=True dropped every row of this epoch: its {self._rows} rows are "
                f"fewer than batch_size={self.batch_size} (a Ray Train worker reads its share "
                f"of the epoch; samples_per_epoch may also be smaller than the dataset). Pass a "
                f"smaller batch_size, or drop_last=False", UserWarning, stacklevel=2)
        self._parts, self._rows, self._yielded = [], 0, 0

    def _flush(self) -> dict[str, np.ndarray]:
        parts, self._parts, self._rows = self._parts, [], 0
        if len(parts) == 1:
            return _read_only(parts[0])
        out = {}
        for k in parts[0]:
            pieces = [p[k] for p in parts]
            first = pieces[0]
            rows = sum(len(v) for v in pieces)
            same = all(v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
                       for v in pieces)
            row_bytes = first.itemsize * int(np.prod(first.shape[1:]))
            if same and first.dtype != object and rows * row_bytes >= REUSE_MIN_BYTES:
                out[k] = np.concatenate(pieces, out=self._reuse.take(
                    (rows, *first.shape[1:]), first.dtype))
            else:  # small columns, and numpy's own promotion where the pieces differ
                out[k] = np.concatenate(pieces)
            # Read-only, as a batch inside one block is (a view of the object store): every
            # batch alike, whatever the batch size; copy a column to write into it.
            out[k].flags.writeable = False
        return out


def _read_only(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` with every column read-only: views of a block are so already when the block
    lies in the object store, but a small block Ray passed inline comes back writable."""
    for v in batch.values():
        v.flags.writeable = False
    return batch


# Seconds a consumer that stops early waits for its prefetch thread before leaving it to end
# on its own (daemon; it ends when the read it waits for returns).
PREFETCH_STOP_WAIT_S = 0.25
# How often a consumer waiting on its prefetch thread asks ``ended`` whether to stop waiting.
PREFETCH_POLL_S = 0.5


def prefetch(source: Iterator[Any], depth: int, convert: Callable[[Any], Any] | None = None,
             stall: list[float] | None = None,
             timed: Callable[[float], None] | None = None,
             left_running: list[threading.Thread] | None = None,
             ended: Callable[[], BaseException | None] | None = None,
             live: set[tuple[threading.Event, threading.Thread]] | None = None
             ) -> Iterator[Any]:
    """Run ``source`` (and ``convert``) in a background thread, ``depth`` items ahead.

    Errors raised in the thread are re-raised in the consumer. ``stall`` (if given) accumulates
    the seconds the consumer waited for an item; ``timed`` receives the loop's wall seconds.
    ``left_running`` receives the thread when the consumer stopped early and the thread was
    still waiting on its source (a read in flight) ``PREFETCH_STOP_WAIT_S`` later: whoever
    shuts the source's resources down (Ray) must wait for it first. ``ended`` (if given) is
    asked every ``PREFETCH_POLL_S`` the consumer waits: an exception it returns is raised
    in the consumer, which stops waiting for the thread (whose source may never return,
    e.g. a wait inside Ray on a session shut down under it). ``live`` holds ``(stop event,
    thread)`` while the thread runs: setting the event stops it at its next item, so that
    the owner can stop an iteration its consumer still holds (``Pipeline.close``).
    """
    began = time.perf_counter()
    try:
        yield from _prefetch(source, depth, convert, stall, left_running, ended, live)
    finally:
        if timed is not None:
            timed(time.perf_counter() - began)
        release_freed_memory()


_LIBC: list[Any] = []


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``), once per
    iteration. Each iteration's prefetch thread allocates its batches (torch's included) in a
    glibc arena of its own, and what those arenas keep free after the thread is gone
    accumulated: a driver's RSS grew ~70 MB over 50 epochs of ``iter_torch_batches`` on 2
    cores, flat with the trim. A no-op where there is no glibc."""
    if not _LIBC:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(libc.malloc_trim)
        except (OSError, AttributeError):
            _LIBC.append(None)
        except ImportError:  # an iterator finalized as the interpreter exits: nothing to trim
            return
    if _LIBC[0] is not None:
        _LIBC[0](0)


def _prefetch(source: Iterator[Any], depth: int, convert: Callable[[Any], Any] | None,
              stall: list[float] | None,
              left_running: list[threading.Thread] | None = None,
              ended: Callable[[], BaseException | None] | None = None,
              live: set[tuple[threading.Event, threading.Thread]] | None = None
              ) -> Iterator[Any]:
    if depth <= 0:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(source)
            except StopIteration:
                return
            if stall is not None:
                stall[0] += time.perf_counter() - t0
            yield convert(item) if convert else item
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        """Queue ``item``; False once the consumer is gone (nobody would take it)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            with no_auto_init():  # a ray.shutdown() meanwhile must not start Ray here
                for item in source:
                    if stop.is_set() or not put(convert(item) if convert else item):
                        break
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            put(_Failure(exc))
        finally:
            put(_DONE)
            if stop.is_set() and hasattr(source, "close"):
                source.close()  # this thread's generator: closed here, where it runs

    thread = threading.Thread(target=work, name="raying-prefetch", daemon=True)
    entry = (stop, thread)
    if live is not None:
        live.add(entry)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            item = _take(q, ended)
            if stall is not None:
                stall[0] += time.perf_counter() - t0
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        # A consumer that stops early (break, an exception, Ctrl-C) waits a moment for the
        # thread, not for the read it may be blocked on (a slow stage, a hung storage
        # read): the thread ends, and closes the source, when that read returns.
        stop.set()
        deadline = time.monotonic() + PREFETCH_STOP_WAIT_S
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                q.get(timeout=0.02)
            except queue.Empty:
                pass
        if thread.is_alive() and left_running is not None:
            left_running[:] = [t for t in left_running if t.is_alive()] + [thread]
        if live is not None:
            live.discard(entry)


def _take(q: queue.Queue, ended: Callable[[], BaseException | None] | None) -> Any:
    """The thread's next item; raises what ``ended`` returns while none comes."""
    if ended is None:
        return q.get()
    while True:
        try:
            return q.get(timeout=PREFETCH_POLL_S)
        except queue.Empty:
            exc = ended()
            if exc is not None:
                raise exc from None


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _channel_stats(name: str, values: Any) -> tuple[float, float, float]:
    """Per-channel mean or std: three finite numbers (one per RGB channel)."""
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or not all(np.isfinite(out)):
        msg = (f"{name} must be 3 finite numbers, one per RGB channel on the 0-1 scale "
               f"(e.g. ImageNet's {name} {DEFAULT_MEAN if name == 'mean' else DEFAULT_STD}), "
               f"got {values!r}")
        raise ConfigError(msg)
    if all(abs(v) > 1 for v in out):
        # Images are scaled to 0-1 before (x - mean) / std: figures on the 0-255 scale would
        # leave every pixel near -2 (mean) or squeeze them into a sliver (std), silently.
        scaled = tuple(round(v / 255, 4) for v in out)
        msg = (f"{name}={values!r} looks like the 0-255 scale; raying normalizes images "
               f"scaled to 0-1, so pass {name} on that scale: {scaled}")
        raise ConfigError(msg)
    return out  # type: ignore[return-value]


# -- torch ---------------------------------------------------------------------------------------
def resolve_device(device: Any):
    """``"auto"`` -> the CUDA device of this process if there is one, else the CPU."""
    import torch

    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"device={device!r} is not a torch device ({exc}); pass 'auto', 'cpu' or 'cuda:0'"
        raise ConfigError(msg) from None
    if out.type == "cuda" and not torch.cuda.is_available():
        msg = (f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA device "
               f"(a CPU build, or no GPU on this node); pass device='auto' to use one when "
               f"there is one, or 'cpu'")
        raise ConfigError(msg)
    return out


class TorchConverter:
    """numpy batch -> dict of torch tensors on ``device`` (uint8 until it gets there).

    Columns of numbers become tensors; object columns (strings, bytes, variable-length lists
    of numbers) become lists with one entry per row: the string or bytes, or a 1-D tensor.

    With ``normalize=True`` the image becomes float32 NCHW, ``(x/255 - mean)/std``, computed
    on the device; the tensor is a channels-last view (NHWC memory), which is what
    convolutions on GPUs prefer. With ``normalize=False`` it stays uint8 NHWC.
    """

    def __init__(self, device: Any, *, normalize: bool, mean=DEFAULT_MEAN, std=DEFAULT_STD,
                 pin_memory: bool | None = None, dtype: Any = None) -> None:
        import torch

        self.torch = torch
        self.device = resolve_device(device)
        self.normalize = normalize
        self.dtype = dtype or torch.float32
        cuda = self.device.type == "cuda"
        self.pin = cuda if pin_memory is None else (pin_memory and cuda)
        mean, std = _channel_stats("mean", mean), _channel_stats("std", std)
        if not all(x > 0 for x in std):
            msg = f"std must be 3 numbers > 0 (per RGB channel, on the 0-1 scale), got {std}"
            raise ConfigError(msg)
        scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
        shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
        self._scale = scale.view(1, 3, 1, 1).to(self.device)
        self._shift = shift.view(1, 3, 1, 1).to(self.device)

    def host(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Zero-copy host tensors (pinned copies when transferring to a GPU)."""
        torch = self.torch
        out = {}
        with warnings.catch_warnings():
            # Blocks from the object store are read-only; the tensors are never written to.
            warnings.simplefilter("ignore", UserWarning)
            for k, v in batch.items():
                if v.dtype == object:  # strings, bytes, variable-length lists: per row
                    out[k] = [self._row(x) for x in v]
                    continue
                if v.dtype.kind in "US":  # numpy's own strings: str / bytes per row, too
                    out[k] = v.tolist()
                    continue
                try:
                    t = torch.from_numpy(np.ascontiguousarray(v))
                except TypeError:
                    msg = (f"column {k!r} holds {v.dtype}, which torch has no tensor type for; "
                           f"convert it in the map_batches function that makes it (e.g. "
                           f"datetime64 to int64 with .astype('int64'), or to str)")
                    raise ConfigError(msg) from None
                out[k] = t.pin_memory() if self.pin else t
        return out

    def _row(self, value: Any) -> Any:
        """One row of a column that is not a tensor: a numeric array becomes a tensor (a
        variable-length list's row), anything else (str, bytes) stays as it is."""
        if isinstance(value, np.ndarray) and value.dtype != object:
            t = self.torch.from_numpy(np.ascontiguousarray(value))
            return t.pin_memory() if self.pin else t
        return value

    def device_put(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, t in batch.items():
            if self.device.type != "cpu":
                if isinstance(t, list):
                    t = [x.to(self.device, non_blocking=self.pin)
                         if isinstance(x, self.torch.Tensor) else x for x in t]
                else:
                    t = t.to(self.device, non_blocking=self.pin)
            out[k] = t
        if self.normalize:
            out["image"] = self.to_float(out["image"])
        return out

    def to_float(self, image):
        """uint8 NHWC -> normalized float NCHW (channels-last memory), where ``image`` is."""
        x = image.permute(0, 3, 1, 2).to(self.dtype)
        return x.mul_(self._scale.to(x.dtype)).sub_(self._shift.to(x.dtype))
