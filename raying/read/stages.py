"""User stages: functions given to ``Pipeline.map_batches``, run in the read tasks.

Each stage takes a block (a dict of numpy arrays: ``image`` uint8 NHWC after decode and crop,
``label``, ``id``, ``weight``, ``prob`` and any extra columns) and returns one. Stages run in
order, after the built-in transform, on every path that runs read tasks (``pipe.iter_*`` and
``pipe.dataset(e)``).

A read task decodes ``DEFAULT_STAGE_ROWS`` rows at a time and runs the stages on them at
once, while the pixels are still in cache (see ``raying.read.task``), in calls of
``stage_call_rows(size)`` rows: at most ``STAGE_CALL_BYTES`` of images, so a function that
works in float32 keeps its temporaries in the core's L2 cache instead of sweeping the shared
L3 or memory (the bench's colour jitter took 1.58 ms per image on 256 rows at once, ~0.6 in
chunks of 16; with two read tasks on two cores, decode, crop and jitter took 1.12-1.15 ms per
image in 1-row calls against 1.23-1.26 in 16-row ones). Chunks start at multiples of
``DEFAULT_STAGE_ROWS`` of the unit's rows, and calls at multiples of their rows within a
chunk, so they are the same however the unit is cut into aligned blocks; they are joined in
order.

A stage with ``with_rng=True`` gets ``rng=``, a ``numpy.random.Generator`` seeded from
(pipeline seed, epoch, the stage's position, the chunk's ids): an epoch is reproducible, and
a retried or resumed read task, which reads the same block, draws the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from raying.errors import ConfigError, UserFunctionError
from raying.image.rng import epoch_key

# Random streams of user stages start here, away from the built-in transform's streams.
_STREAM_BASE = 1 << 20
# Columns every block carries whose dtype a stage may not change (their values it may): the
# sampler and the trainers' importance weighting read them.
_RESERVED_DTYPES = {"weight": "float32", "prob": "float64"}
# Rows of a block decoded together before the stages run on them (as many as the ids a
# UserFunctionError names, IDS_SHOWN: a failing call's ids are all shown).
DEFAULT_STAGE_ROWS = 16
# Bytes of images one call of the stages sees at most: a stage that works in float32 makes
# temporaries of 4x that, which then stay within a core's L2 cache (1 row of 224 px).
STAGE_CALL_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class UserStage:
    """One ``map_batches`` call: the function and how to call it."""

    fn: Callable[..., Any]
    with_rng: bool = False
    fn_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """The function's qualified name (and module), for error messages."""
        fn = self.fn
        if isinstance(fn, functools.partial):  # the function it wraps names it
            return f"functools.partial({UserStage(fn.func).name})"
        qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        module = getattr(fn, "__module__", None)
        return f"{module}.{qual}" if module and module not in ("__main__", "builtins") else qual


class StageChain(tuple):
    """A pipeline's stages, in order, as a read spec carries them.

    Pickled, their functions travel together as bytes of their own (one payload, so that
    functions of the driver's script share its globals in the worker, as they do in the
    driver), loaded where they arrive by :func:`_shipped_chain`: functions a worker cannot
    load (their module missing on its node) then fail their calls by name, instead of the
    read task's arguments, which Ray Data retries without end and the iterator path
    reports with no function named. Their ``fn_kwargs`` stay with the outer pickler (Ray's
    ships arrays in them without a copy).
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_shipped_chain, (tuple(s.name for s in self), tuple(s.with_rng for s in self),
                                 tuple(s.fn_kwargs for s in self),
                                 _dumps([s.fn for s in self])))


class StageLoadError(ImportError):
    """A stage's function could not be loaded in the process that was to call it."""

    def __init__(self, message: str, traceback_text: str) -> None:
        super().__init__(message)
        self.traceback_text = traceback_text


class _Unloadable:
    """Stands in for a function that could not be loaded: each call raises why."""

    def __init__(self, name: str, message: str, traceback_text: str) -> None:
        self.__qualname__ = name  # UserStage.name reads these
        self.__module__ = "__main__"
        self.message, self.traceback_text = message, traceback_text

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StageLoadError(self.message, self.traceback_text)


def _dumps(obj: Any) -> bytes:
    try:
        from ray import cloudpickle
    except ImportError:  # pragma: no cover - Ray is a dependency
        import pickle as cloudpickle  # type: ignore[no-redef]
    return cloudpickle.dumps(obj)


def _shipped_chain(names: tuple[str, ...], with_rng: tuple[bool, ...],
                   fn_kwargs: tuple[Any, ...], payload: bytes) -> StageChain:
    """A :class:`StageChain` from its pickled form; where its functions cannot be loaded
    here, each stage gets a stand-in that says so, by name, when it is called."""
    import pickle

    try:
        fns = pickle.loads(payload)  # noqa: S301 - the pipeline's own stages
    except Exception as exc:  # noqa: BLE001 - said at the call, which names the epoch and ids
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        others = " (with the pipeline's other map_batches functions)" if len(names) > 1 else ""
        message = (f"cannot be loaded in the read worker{others} ({type(exc).__name__}: "
                   f"{exc}): the module that defines it, and what it uses, must be "
                   f"importable on every node. Install it there, or ship it with Ray's "
                   f"runtime environment (ray.init(runtime_env={{'py_modules': [module]}}) or "
                   f"{{'working_dir': ...}}), or define the function in the driver's script")
        fns = [_Unloadable(name, message, text) for name in names]
    return StageChain(UserStage(fn, rng, kw)
                      for fn, rng, kw in zip(fns, with_rng, fn_kwargs, strict=True))


def stage_call_rows(size: int) -> int:
    """Rows per call of the stages for ``size`` px images: the largest power of two up to
    ``DEFAULT_STAGE_ROWS`` whose images fit ``STAGE_CALL_BYTES`` (at least 1). A function of
    the size only, so calls cut a chunk alike on every worker (their rngs key by the ids)."""
    rows = DEFAULT_STAGE_ROWS
    while rows > 1 and rows * size * size * 3 > STAGE_CALL_BYTES:
        rows //= 2
    return rows


def stage_rng(seed: int, epoch: int, index: int, ids: np.ndarray) -> np.random.Generator:
    """The generator of stage ``index`` for a block of ``ids``: a function of (seed, epoch,
    index, ids) only, so whichever worker reads the block, and however often, draws alike."""
    digest = hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(),
                             digest_size=16).digest()
    words = [int.from_bytes(digest[k:k + 4], "little") for k in range(0, 16, 4)]
    key = epoch_key(seed, epoch, _STREAM_BASE + index)
    return np.random.default_rng([key & 0xFFFFFFFF, key >> 32, *words])


def apply_stages(stages: tuple[UserStage, ...], block: dict[str, np.ndarray], *, seed: int,
                 epoch: int, size: int) -> dict[str, np.ndarray]:
    """Run ``stages`` in order on ``block``, ``DEFAULT_STAGE_ROWS`` rows at a time; each
    result is checked before the next stage runs, and the chunks are joined in order.

    Raises:
        UserFunctionError: a stage raised (its traceback in the message), or returned
            something other than a dict whose ``id`` is the block's and whose columns all
            have the block's rows, with ``image`` still uint8 ``(n, size, size, 3)``, or
            chunks of one block that return different columns.
    """
    n = len(block["id"])
    if n <= DEFAULT_STAGE_ROWS:
        return run_chunk(stages, block, seed=seed, epoch=epoch, size=size)
    parts = [run_chunk(stages, {k: v[a:a + DEFAULT_STAGE_ROWS] for k, v in block.items()},
                       seed=seed, epoch=epoch, size=size)
             for a in range(0, n, DEFAULT_STAGE_ROWS)]
    return join(stages, parts, epoch=epoch)


def join(stages: tuple[UserStage, ...], parts: list[dict[str, np.ndarray]], *,
         epoch: int, image: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The stages' outputs of consecutive chunks as one block (checked: same columns).
    ``image``, when given, is the parts' images already joined (a read task's buffer)."""
    if len(parts) == 1:
        return parts[0] if image is None else {**parts[0], "image": image}
    keys = list(parts[0])
    for part in parts[1:]:
        if sorted(part) != sorted(keys):
            name = " then ".join(s.name for s in stages)
            raise UserFunctionError(name, epoch, part["id"],
                                    f"returned columns {sorted(part)} for some rows and "
                                    f"{sorted(keys)} for others; return the same columns "
                                    f"for every batch")
    bad = layout_mismatch(parts)
    if bad is not None:
        name = " then ".join(s.name for s in stages)
        raise UserFunctionError(name, epoch, parts[bad[0]]["id"], bad[1])
    return {k: image if k == "image" and image is not None else
            np.concatenate([p[k] for p in parts]) for k in keys}


def _layout(value: np.ndarray) -> tuple[str, tuple[int, ...]]:
    """A column's dtype (strings of any width alike) and its shape past the rows."""
    kind = value.dtype.kind
    return ("str" if kind == "U" else "bytes" if kind == "S" else str(value.dtype),
            tuple(value.shape[1:]))


def layout_mismatch(parts: list[dict[str, np.ndarray]]) -> tuple[int, str] | None:
    """``(index of the part, the problem)`` when a column of consecutive parts differs in
    dtype or in its shape past the rows (numpy would merge int64 into float64 silently, or
    fail with its own words), else None."""
    first = parts[0]
    for index, part in enumerate(parts[1:], 1):
        for key, value in part.items():
            ref = first.get(key)
            if ref is None or (value.dtype == ref.dtype and value.shape[1:] == ref.shape[1:]):
                continue  # the common case, without formatting the dtypes
            want, got = _layout(ref), _layout(value)
            if got != want:
                return index, (f"returned column {key!r} as {got[0]} of row shape {got[1]} "
                               f"for some rows and {want[0]} of row shape {want[1]} for "
                               f"others; return the same dtype and row shape for every batch")
    return None


def column_template(block: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A block's columns as empty arrays of their dtypes and row shapes: what
    :func:`columns_problem` compares (small enough to send to an actor)."""
    return {k: np.empty((0, *v.shape[1:]), v.dtype) for k, v in block.items()}


def columns_problem(first: Mapping[str, np.ndarray],
                    block: Mapping[str, np.ndarray]) -> str | None:
    """How ``block``'s columns differ from those of an epoch's ``first`` block (its
    :func:`column_template` will do), or None: other names, or a column of another dtype or
    row shape. A trainer expects the same keys, dtypes and shapes in every batch, and a batch
    that spans two blocks joins them (numpy would merge int64 into float64 silently; Ray Data
    fills a missing column with nulls and unifies dtypes)."""
    got, want = sorted(block), sorted(first)
    if got != want:
        return (f"returned columns {got} for some blocks and {want} for others; return the "
                f"same columns for every batch")
    bad = layout_mismatch([dict(first), dict(block)])
    return None if bad is None else bad[1]


def stage_names(stages: tuple[UserStage, ...]) -> str:
    """The stages' names in order, as a UserFunctionError names them."""
    return " then ".join(s.name for s in stages) or "(none)"


def chunk_rngs(stages: tuple[UserStage, ...], seed: int, epoch: int,
               ids: np.ndarray) -> list[np.random.Generator | None]:
    """Each stage's generator for the chunk of ``ids`` (None for a stage without
    ``with_rng``): the calls a chunk is cut into draw from them in turn."""
    return [stage_rng(seed, epoch, index, ids) if stage.with_rng else None
            for index, stage in enumerate(stages)]


def run_chunk(stages: tuple[UserStage, ...], block: dict[str, np.ndarray], *, seed: int,
              epoch: int, size: int,
              rngs: list[np.random.Generator | None] | None = None) -> dict[str, np.ndarray]:
    """Run ``stages`` in order on one chunk of at most ``DEFAULT_STAGE_ROWS`` rows, or on one
    call's rows of it: ``rngs`` are then the chunk's generators (:func:`chunk_rngs`), which
    its calls share in order, so a chunk draws the same numbers however it is cut."""
    ids = block["id"]
    n = len(ids)
    if rngs is None and any(stage.with_rng for stage in stages):
        rngs = chunk_rngs(stages, seed, epoch, ids)
    for index, stage in enumerate(stages):
        kwargs = dict(stage.fn_kwargs)
        if stage.with_rng:
            kwargs["rng"] = rngs[index]  # type: ignore[index]
        try:
            out = stage.fn(block, **kwargs)
        except StageLoadError as exc:
            raise UserFunctionError(stage.name, epoch, ids, str(exc),
                                    exc.traceback_text) from None
        except Exception as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            err = UserFunctionError(stage.name, epoch, ids,
                                    f"raised {type(exc).__name__}: {exc}", text)
            raise err from exc
        block = _checked(stage, out, ids, n, size, epoch)
    return block


def _checked(stage: UserStage, out: Any, ids: np.ndarray, n: int, size: int,
             epoch: int) -> dict[str, np.ndarray]:
    def bad(problem: str) -> UserFunctionError:
        return UserFunctionError(stage.name, epoch, ids, problem)

    if not isinstance(out, Mapping):
        raise bad(f"returned {type(out).__name__}; expected the batch: a dict of numpy "
                  f"arrays (return the dict it was given, changed)")
    out = dict(out)
    odd = [k for k in out if not isinstance(k, str)]
    if odd:
        raise bad(f"returned the column key {odd[0]!r} ({type(odd[0]).__name__}); name "
                  f"columns by strings, e.g. {str(odd[0])!r}")
    got = out.get("id")
    if got is None or not np.array_equal(np.asarray(got), ids):
        raise bad("changed or dropped the 'id' column; expected the ids it was given, in "
                  "order (a stage may change values, not which rows there are: filter or "
                  "reorder with the sampler instead)")
    got_dtype = np.asarray(got).dtype
    if got_dtype.kind not in "iu":
        raise bad(f"returned the 'id' column as {got_dtype}; keep the ids as they came "
                  f"(int64): the priority store and resume positions index by them")
    out["id"] = ids  # the ids it was given (int64), whatever integer type came back
    if "label" not in out:
        raise bad("dropped the 'label' column; keep it (a stage may change its values or "
                  "dtype, e.g. soft labels of shape (n, classes)) and put other targets in "
                  "columns of their own")
    for key, dtype in _RESERVED_DTYPES.items():
        if key not in out:
            raise bad(f"dropped the {key!r} column; keep it as it came ({dtype})")
        value = _array(out[key], key, bad)
        if value.dtype.kind not in "biuf" or value.shape != (n,):
            raise bad(f"returned the {key!r} column as {value.dtype} {value.shape}; expected "
                      f"{dtype} ({n},): one number per row")
        out[key] = value.astype(dtype, copy=False)  # the same dtype on every path
    weight = out["weight"]
    if not (np.isfinite(weight).all() and (weight >= 0).all()):
        # The trainer multiplies its loss by it: one NaN makes the step's gradient NaN.
        wrong = weight[~(np.isfinite(weight) & (weight >= 0))]
        raise bad(f"returned 'weight' values {wrong[:4].tolist()}; importance weights must be "
                  f"finite and >= 0 (0 leaves a row out of the loss)")
    label = _array(out["label"], "label", bad)
    if label.dtype.kind not in "biuf":
        raise bad(f"returned the 'label' column as {label.dtype}; expected numbers (int64 "
                  f"class ids, or floats such as soft labels); put other values in a column "
                  f"of their own")
    for key, value in out.items():
        if not isinstance(value, np.ndarray):
            try:
                value = out[key] = np.asarray(value)
            except (TypeError, ValueError) as exc:
                raise bad(f"returned column {key!r} as {type(value).__name__}, which is not "
                          f"an array ({exc}); return numpy arrays") from None
        if value.ndim == 0 or len(value) != n:
            rows = "a scalar" if value.ndim == 0 else f"{len(value)} rows"
            raise bad(f"returned column {key!r} with {rows}; expected {n} rows, one per id")
        if value.ndim == 1 and value.dtype.kind in "US":
            # Fixed-width strings as Parquet's string columns come: objects (str, bytes),
            # which is what the dataset path's Arrow strings give back too.
            out[key] = value.astype(object)
    image = out.get("image")
    if image is None or image.dtype != np.uint8 or image.shape != (n, size, size, 3):
        got_image = "no 'image'" if image is None else f"{image.dtype} {image.shape}"
        raise bad(f"returned {got_image}; expected 'image' as uint8 ({n}, {size}, {size}, 3) "
                  f"(the size is ImageTransform(size=...); convert to float on the device: "
                  f"iter_torch_batches(normalize=True), or add another column)")
    return out


def _array(value: Any, key: str, bad: Callable[[str], UserFunctionError]) -> np.ndarray:
    """A returned column as a numpy array, or the stage's error (a ragged list of rows)."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise bad(f"returned column {key!r} as {type(value).__name__}, which is not an array "
                  f"({exc}); return numpy arrays") from None


def check_stage(stage: UserStage) -> None:
    """Refuse, at ``map_batches`` and before any read, a stage the read tasks could not run:
    a call its signature does not take, or a function Ray cannot ship.

    Raises:
        ConfigError: naming the function and the fix.
    """
    _check_call(stage.fn, stage.with_rng, dict(stage.fn_kwargs))
    _check_pickles(stage)


def _check_call(fn: Callable[..., Any], with_rng: bool, kwargs: dict[str, Any]) -> None:
    """Refuse, before any read, a stage its read tasks could not call: ``fn(batch,
    rng=..., **fn_kwargs)`` must bind to its signature (one it does not show, e.g. a
    builtin's, is taken as it is)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    call = {**kwargs, **({"rng": None} if with_rng else {})}
    try:
        sig.bind(None, **call)
    except TypeError as exc:
        name = (UserStage(fn).name if isinstance(fn, functools.partial)
                else getattr(fn, "__qualname__", None) or type(fn).__qualname__)
        how = "fn(batch" + "".join(f", {k}=..." for k in call) + ")"
        hint = ""
        if "'rng'" in str(exc):
            hint = (" (with_rng=True passes rng=: add an rng parameter, or pass "
                    "with_rng=False)" if with_rng else " (pass with_rng=True to get rng=)")
        msg = (f"map_batches: the read tasks call {how}, which {name}{sig} does not take: "
               f"{exc}{hint}")
        raise ConfigError(msg) from None


def _check_pickles(stage: UserStage) -> None:
    """Refuse, now and by name, a stage Ray could not ship to the read workers."""
    try:
        from ray import cloudpickle
    except ImportError:  # pragma: no cover - Ray is a dependency
        import pickle as cloudpickle  # type: ignore[no-redef]
    try:
        cloudpickle.dumps(stage)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises (ctypes: ValueError)
        msg = (f"map_batches function {stage.name} (or its fn_kwargs) cannot be pickled "
               f"({type(exc).__name__}: {exc}); Ray ships it to the read workers: keep what "
               f"it closes over picklable (no open files, locks or clients; create those "
               f"inside the function)")
        raise ConfigError(msg) from None
