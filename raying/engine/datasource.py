"""A Ray Data datasource whose read tasks run an epoch plan's units (read+decode+augment)."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import numpy as np

from raying.engine.metrics import RunAccount, all_bad_message
from raying.errors import ConfigError, DataError, RayingError, UserFunctionError
from raying.options import use
from raying.read.account import UnitAccount
from raying.read.spec import ReadSpec
from raying.read.stages import column_template, stage_names
from raying.read.task import empty_block, iter_unit
from raying.sampling.plan import EpochPlan, ManifestLookup, ReadUnit
from raying.sampling.protocol import Sampler

logger = logging.getLogger("raying")

# Attempts of an account call whose actor is restarting after its process was lost.
DEFAULT_ACCOUNT_TASK_RETRIES = 3

# Ray options that read_datasource takes by name (ray_remote_args is deprecated in 2.60).
_READ_ARG_NAMES = ("num_cpus", "num_gpus", "memory", "resources", "label_selector",
                   "accelerator_type", "runtime_env", "max_calls")


@functools.cache
def _account_actor_cls():
    """The accounts actor's class, made once per process (each ``@ray.remote`` class is a
    new type that Ray registers, and a driver making one per dataset grows with them)."""
    import ray

    # A lost process (OOM, a node gone) restarts the actor, and the calls in flight are
    # retried on it: the reads go on, their account from then on (close() kills it for good).
    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=DEFAULT_ACCOUNT_TASK_RETRIES)
    class _Accounts:
        """Collects the accounts of read tasks run by Ray Data (skips, rows, bytes), logs the
        samples set aside (once each) and gives them priority 0 in the store, if any."""

        def __init__(self, store: Any = None) -> None:
            self.account = RunAccount()
            self.store = store
            with warnings.catch_warnings():  # Ray's property reads a deprecated actor_id
                warnings.simplefilter("ignore", DeprecationWarning)
                restarted = ray.get_runtime_context().was_current_actor_reconstructed
            if restarted:
                logger.warning("the account of a pipeline's dataset reads was lost with its "
                               "process and starts again: pipe.stats() covers the reads "
                               "from now on")
            # Per epoch: units whose last block came in, rows read and delivered, first skips.
            self.epochs: dict[int, dict[str, Any]] = {}
            # Per epoch: the columns of the first block with rows (see _same_columns).
            self.columns: dict[int, dict[str, Any]] = {}

        def add(self, account: UnitAccount, units: int = 0, samples: int = 0,
                root: str = "", columns: tuple[dict[str, Any], dict[str, str]] | None = None
                ) -> tuple[str | None, str | None]:
            """Take one block's account and check its ``columns`` (user stages' output: a
            ``column_template`` and ``_object_rows``), in one call. Returns (the error for an
            epoch of ``units`` units whose every sample read was bad, once its last unit is
            in; how the columns differ from the epoch's first block's), each None if none."""
            self._record(account)
            problem = None if columns is None else self._same_columns(account.epoch, *columns)
            return self._all_bad(account, units, samples, root), problem

        def _all_bad(self, account: UnitAccount, units: int, samples: int,
                     root: str) -> str | None:
            ep = self.epochs.setdefault(account.epoch, {"done": set(), "rows_in": 0,
                                                        "rows_out": 0, "skips": []})
            ep["rows_in"] += account.rows_in
            ep["rows_out"] += account.rows_out
            ep["skips"].extend(account.skipped[:3 - len(ep["skips"])])
            if account.final:
                ep["done"].add(account.unit)
            if not units or len(ep["done"]) < units:
                return None
            return all_bad_message(ep["rows_in"], ep["rows_out"], ep["skips"], samples, root,
                                   account.epoch)

        def _record(self, account: UnitAccount) -> None:
            fresh = self.account.add(account)
            if fresh:
                self.account.end_epoch(account.epoch)
                if self.store is not None:
                    import numpy as np

                    from raying.sampling.store import flush, update_async

                    # Priority 0 outright, not folded by the store's coalesce mode (as
                    # PrioritizedSampler.set_aside does on the iterator path).
                    update_async(self.store, np.asarray(fresh, dtype=np.int64),
                                 np.zeros(len(fresh)), exact=True)
                    flush(self.store)  # landed before the read task yields its block

        def _same_columns(self, epoch: int, template: dict[str, Any],
                          rows: dict[str, str]) -> str | None:
            """Check a block's columns (user stages') against the first block of ``epoch``
            any read task brought: how they differ, or None. The iterator path checks its
            blocks as it joins them; Ray Data would merge them (nulls, unified dtypes).
            ``rows``: what the rows of each object column are (see ``_object_rows``)."""
            from raying.read.stages import columns_problem

            first = self.columns.setdefault(epoch, (template, rows))
            if first[0] is template:
                return None
            problem = columns_problem(first[0], template)
            if problem is not None:
                return problem
            for name, kind in rows.items():
                if first[1].get(name) != kind:
                    return (f"returned column {name!r} with rows of {kind} for some blocks and "
                            f"of {first[1].get(name)} for others; return rows of one dtype "
                            f"in every batch (Ray Data would unify them)")
            return None

        def add_retries(self, retries: int) -> None:
            """Retries of a read task that failed, lost with its account."""
            self.account.retries += int(retries)

        def summary(self) -> dict[str, Any]:
            return self.account.summary()

        def skipped_ids(self) -> list[int]:
            """Every id the reads set aside as bad (the summary lists only the first ones)."""
            return sorted(self.account.skipped_ids())

    return _Accounts


def _closed(exc: BaseException) -> ConfigError:
    return ConfigError(f"this dataset's pipeline was closed, or its account or priority store "
                       f"is gone ({type(exc).__name__}); iterate pipe.dataset(e) before "
                       f"pipe.close(), or build the pipeline again")


def _read(spec_ref: Any, unit: ReadUnit, lookup_ref: Any, sampler: Any, accounts: Any,
          block_rows: int, epoch_units: int = 0, samples: int = 0, root: str = ""):
    """A read task of ``pipe.dataset(e)``: one plan unit of an epoch of ``epoch_units``.

    Every block's account goes to the account actor before the block is yielded; the task
    that brings in an epoch's last unit raises DataError if every sample the epoch read was
    set aside (a wrong image column, say), as the iterator path does: Ray Data would
    otherwise hand the trainer an empty epoch."""
    import ray
    from ray.exceptions import RayActorError

    from raying.storage.errors import counted_retries

    spec: ReadSpec = ray.get(spec_ref) if isinstance(spec_ref, ray.ObjectRef) else spec_ref
    use(spec.settings)  # before a lazy unit is drawn: the driver's plan chunk and retries

    if unit.ids is None:  # prioritized: draw now, so losses reported so far shape this read
        try:
            unit = sampler.fill(unit)
        except RayActorError as exc:
            raise _closed(exc) from None
    lookup: ManifestLookup = ray.get(lookup_ref)
    unit, paths = lookup.complete(unit)
    mark = [counted_retries()]  # the retry count when the last block's account was taken
    try:
        yield from _read_blocks(spec, unit, paths, accounts, block_rows, epoch_units, samples,
                                root, mark)
    except RayingError:
        # An error takes the unit's account with it: its retries since the last block's
        # account go to the account actor, as the iterator path's driver adds them.
        lost = counted_retries() - mark[0]
        if lost and accounts is not None:
            try:
                ray.get(accounts.add_retries.remote(lost))
            except RayActorError:
                pass  # the pipeline was closed: nobody reads its account any more
        raise


def _read_blocks(spec: ReadSpec, unit: ReadUnit, paths: list[str], accounts: Any,
                 block_rows: int, epoch_units: int, samples: int, root: str,
                 mark: list[int]):
    """``_read``'s blocks as Arrow; ``mark[0]`` is set to the retry count at each account."""
    import ray
    from ray.data.block import BlockAccessor
    from ray.exceptions import RayActorError

    from raying.storage.errors import counted_retries

    yielded = False
    for block, account in iter_unit(spec, unit, paths, block_rows=block_rows):
        staged = bool(spec.stages) and len(block["id"]) > 0
        if staged:
            _refuse_unarrowable(spec, block, unit.epoch)
        if accounts is not None:  # landed before the block is seen: stats() are complete
            columns = (column_template(block), _object_rows(block)) if staged else None
            try:
                refused, problem = ray.get(accounts.add.remote(account, epoch_units, samples,
                                                               root, columns))
            except RayActorError as exc:
                raise _closed(exc) from None
            mark[0] = counted_retries()  # this block's retries are in its account now
            if refused:
                raise DataError(refused)
            if problem is not None:
                raise _stage_refusal(spec, block, unit.epoch, problem)
        if len(block["id"]) == 0:
            if yielded or not account.final or spec.stages:
                # A task yields an empty block only when it has nothing else, and not with
                # user stages, whose columns it cannot know without rows (Ray Data is content
                # with a read task that yields no block).
                continue
            yielded = True
            yield empty_arrow_block(spec.transform.size, spec.columns)
            continue
        yielded = True
        yield BlockAccessor.batch_to_block(_arrow_lists(block, spec.columns))


def empty_arrow_block(size: int, columns: tuple[tuple[str, Any], ...] = ()):
    """A block of no rows whose Arrow types are those of the blocks with rows. Ray Data makes
    a zero-row column of images, fixed-width arrays or strings one of pickled Python objects
    (and logs that it did); each such column is cut from a one-row column instead."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    block = _arrow_lists(empty_block(size, columns), columns)
    block["image"] = block.pop("image")  # last, as in the read task's blocks
    kinds = {name: desc["kind"] for name, desc in columns}
    fields = []
    for name, value in block.items():
        if isinstance(value, np.ndarray) and (value.ndim > 1 or value.dtype == object):
            kind = kinds.get(name)
            if kind == "string":
                fields.append((name, pa.array([], type=pa.string())))
                continue
            if kind == "bytes":
                fields.append((name, pa.array([], type=pa.binary())))
                continue
            one = np.zeros((1, *value.shape[1:]), dtype=value.dtype)
            col = BlockAccessor.batch_to_block({name: one}).column(name)
            fields.append((name, col.slice(0, 0)))
        else:
            fields.append((name, value))
    return pa.table({name: value for name, value in fields})


def _stage_refusal(spec: ReadSpec, block: dict[str, Any], epoch: int,
                   problem: str) -> UserFunctionError:
    return UserFunctionError(stage_names(spec.stages), epoch, block["id"], problem)


# Time units Arrow's timestamp and duration types have (numpy's others are converted).
_ARROW_UNITS = ("s", "ms", "us", "ns")


def _refuse_unarrowable(spec: ReadSpec, block: dict[str, Any], epoch: int) -> None:
    """Refuse, as the iterator path does, stage output Ray Data would change without a word:
    a column holding None (it comes back NaN) or complex numbers (no Arrow type: they come
    back as Python objects), str and bytes in one column (all come back bytes), dates and
    durations in units Arrow has no type for (a
    ``datetime64[D]`` comes back as ``datetime64[s]``, a ``timedelta64[D]`` as Python
    objects). Columns that differ from the epoch's first block's (Ray Data fills a missing
    one with nulls and unifies dtypes) are checked by the account actor."""
    for name, value in block.items():
        if value.dtype.kind in "mM" and np.datetime_data(value.dtype)[0] not in _ARROW_UNITS:
            kind = "datetime64" if value.dtype.kind == "M" else "timedelta64"
            raise _stage_refusal(
                spec, block, epoch,
                f"returned column {name!r} as {value.dtype}, which pipe.dataset(e) (Ray Data's "
                f"Arrow blocks) would change to another unit or to Python objects; return it "
                f"as {kind}[s] (or ms, us, ns: .astype('{kind}[s]'))")
        if value.dtype.kind == "c":
            raise _stage_refusal(
                spec, block, epoch,
                f"returned column {name!r} as {value.dtype}, which pipe.dataset(e) (Ray Data's "
                f"Arrow blocks) cannot carry as numbers; return the real and imaginary parts "
                f"as two float columns")
        if value.dtype == object and _text_and_bytes(value):
            raise _stage_refusal(
                spec, block, epoch,
                f"returned column {name!r} mixing str and bytes, which pipe.dataset(e) (Ray "
                f"Data's Arrow blocks) turns into bytes throughout; return one of the two "
                f"(s.decode() or s.encode())")
        if value.dtype == object and any(v is None for v in value):
            raise _stage_refusal(
                spec, block, epoch,
                f"returned column {name!r} with None in it, which pipe.dataset(e) (Ray Data's "
                f"Arrow blocks) turns into NaN or drops; return numbers (NaN for a missing "
                f"value) and, if it matters, a mask column")


def _text_and_bytes(value: np.ndarray) -> bool:
    """Whether an object column holds both str and bytes rows."""
    text = any(isinstance(v, str) for v in value)  # np.str_ is a str, np.bytes_ bytes
    return text and any(isinstance(v, bytes) for v in value)


def _object_rows(block: dict[str, Any]) -> dict[str, str]:
    """What the rows of each object column are, as ``_arrow_lists`` will carry them: 1-D
    arrays of one numeric dtype become a list column of it, anything else stays Python
    objects (a block of float32 rows and one of float64 rows would be unified by Ray Data);
    text and bytes are told apart (a block of str rows and one of bytes rows would come back
    as bytes throughout)."""
    out = {}
    for name, value in block.items():
        if isinstance(value, np.ndarray) and value.dtype == object and len(value):
            kinds = {str(r.dtype) if isinstance(r, np.ndarray) and r.ndim == 1
                     and r.dtype.kind in "biuf" else None for r in value}
            one = kinds.pop() if len(kinds) == 1 else None
            if one is not None:
                out[name] = f"1-D {one} arrays"
            elif all(isinstance(r, str) for r in value):
                out[name] = "str"
            elif all(isinstance(r, bytes) for r in value):
                out[name] = "bytes"
            else:
                out[name] = "Python objects"
    return out


def _arrow_lists(block: dict[str, Any],
                 columns: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Per-row numeric arrays (variable-length list columns, and such columns a stage adds)
    as Arrow list arrays. Left to Ray Data, an object column becomes a fixed-shape tensor in
    a block whose rows happen to have one length and a variable-shaped one in the next, so
    a trainer's batches would be 2-D arrays or object arrays by chance; as lists every batch
    holds an object array of 1-D arrays, as on the iterator path."""
    import pyarrow as pa

    lists = {name: desc["dtype"] for name, desc in columns if desc["kind"] == "list"}
    out = dict(block)
    for name, value in block.items():
        if not isinstance(value, np.ndarray) or value.dtype != object:
            continue
        dtype = lists.get(name)
        if dtype is None:  # a stage's column: lists only when every row is a 1-D number array
            rows = list(value)
            if not rows or not all(isinstance(r, np.ndarray) and r.ndim == 1
                                   and r.dtype.kind in "biuf" for r in rows):
                continue
            if len({r.dtype for r in rows}) != 1:
                continue
            dtype = rows[0].dtype
        out[name] = pa.array(list(value), type=pa.list_(pa.from_numpy_dtype(np.dtype(dtype))))
    return out


class DatasetReads:
    """The Ray Data side of one pipeline: what its read tasks share, and their account.

    Made by the first ``pipe.dataset(e)``: the read spec and the per-id lookup go to the object
    store once, and an account actor collects what the read tasks did (rows, skips, bytes),
    so ``pipe.stats()`` covers reads run by Ray Data, e.g. in Ray Train workers.
    :meth:`release` stops the actor and keeps its final account.
    """

    def __init__(self, spec: ReadSpec, lookup: ManifestLookup, store: Any) -> None:
        import ray

        self.spec_ref = ray.put(spec)
        self.lookup_ref = ray.put(lookup)
        from raying.sampling.store import head_placement

        # On the head, as the priority store: a worker node lost (a spot instance) would
        # restart it empty, and stats() would lose the counts and skips read so far.
        self.accounts: Any = _account_actor_cls().options(**head_placement()).remote(store)
        self._final: dict[str, Any] | None = None

    def dataset(self, plan: EpochPlan, *, sampler: Sampler, block_rows: int, fmt: str,
                size: int, ray_remote_args: dict[str, Any] | None, samples: int = 0,
                root: str = ""):
        """The ``ray.data.Dataset`` of ``plan``: one read task per plan unit (``samples``
        and ``root``, the manifest's, name an epoch whose every sample is bad)."""
        import ray
        from ray.data.block import BlockMetadata
        from ray.data.datasource import Datasource, ReadTask

        if self.accounts is None:
            msg = "this pipeline's dataset reads were released (the pipeline is closed)"
            raise RuntimeError(msg)
        spec_ref, lookup_ref, accounts = self.spec_ref, self.lookup_ref, self.accounts
        units = plan.units
        name = f"Raying({fmt})"
        # Ray Data spreads read tasks over nodes by default; other options go by name.
        remote_args = {k: v for k, v in (ray_remote_args or {}).items()
                       if k in _READ_ARG_NAMES}
        # Nothing below may close over a Pipeline or this object: Ray Train pickles the
        # dataset, and a Pipeline holds locks and threads.

        class _PlanDatasource(Datasource):
            def get_name(self) -> str:
                return name

            def estimate_inmemory_data_size(self) -> int:
                return int(plan.num_rows * size * size * 3)

            def get_read_tasks(  # type: ignore[override]
                    self, parallelism: int, per_task_row_limit: int | None = None,
                    **_: Any) -> list[ReadTask]:
                tasks = []
                for unit in units:
                    meta = BlockMetadata(num_rows=None,
                                         size_bytes=int(unit.num_rows * size * size * 3),
                                         exec_stats=None, input_files=None)
                    fn = functools.partial(_read, spec_ref, unit, lookup_ref, sampler, accounts,
                                           block_rows, len(units), samples, root)
                    tasks.append(ReadTask(fn, meta))
                return tasks

        return ray.data.read_datasource(_PlanDatasource(), override_num_blocks=max(1, len(units)),
                                        **remote_args)

    def account(self) -> dict[str, Any] | None:
        """The account of the reads Ray Data ran: live, or as :meth:`release` kept it; on error
        (Ray shut down) ``{"error": ...}``."""
        if self.accounts is None:
            return self._final
        try:
            import ray

            return ray.get(self.accounts.summary.remote())
        except Exception as exc:  # noqa: BLE001 - Ray gone (shut down): say so, keep the rest
            return {"error": f"{type(exc).__name__}: {exc}"}

    def skipped_ids(self) -> list[int]:
        """Every id the dataset reads set aside so far (none once released)."""
        if self.accounts is None:
            return []
        import ray

        return ray.get(self.accounts.skipped_ids.remote())

    def forget(self) -> None:
        """Let go of the account actor of a Ray session that has ended (gone with it)."""
        if self.accounts is not None:
            self._final = {"error": "the Ray session of these reads ended before close()"}
        self.accounts = None
        self.spec_ref = self.lookup_ref = None

    def release(self) -> None:
        """Stop the account actor, keeping its final account."""
        if self.accounts is None:
            return
        self._final = self.account()
        with contextlib.suppress(Exception):
            import ray

            ray.kill(self.accounts)
        self.accounts = None
        # The spec and the label lookup (8 B a sample) stay in the object store only while a
        # dataset taken before holds them, not for as long as the closed pipeline lives.
        self.spec_ref = self.lookup_ref = None


def merge_dataset_account(out: dict[str, Any], reads: dict[str, Any]) -> None:
    """Add the reads Ray Data ran for ``pipe.dataset(e)`` (e.g. in Ray Train workers) to
    ``out``: their summary under ``"dataset"``, their skipped samples in ``"skipped"`` (a
    sample both paths set aside listed once, at its first skip: the earlier epoch's entry),
    their skip events in ``"skip_events"``."""
    if "error" in reads:
        out["dataset"] = reads
        return
    # What the read tasks did; what their consumers took (rows delivered, rates, stalls)
    # happens in Ray Data's iterators, out of this account's sight.
    out["dataset"] = {k: v for k, v in reads.items()
                      if k not in ("rows_delivered", "throughput_rows_per_s", "stall_s",
                                   "stall_share")}
    out["skip_events"] = out.get("skip_events", 0) + reads.get("skip_events", 0)
    out["read_retries"] = out.get("read_retries", 0) + reads.get("read_retries", 0)
    by_reason = out["skipped_by_reason"]
    where = {s["id"]: k for k, s in enumerate(out["skipped"])}
    for s in reads["skipped"]:
        k = where.get(s["id"])
        if k is None:
            where[s["id"]] = len(out["skipped"])
            out["skipped"].append(s)
            out["skipped_count"] += 1
            by_reason[s["reason"]] = by_reason.get(s["reason"], 0) + 1
        elif s.get("epoch", 0) < out["skipped"][k].get("epoch", 0):
            old = out["skipped"][k]["reason"]
            by_reason[old] -= 1
            if not by_reason[old]:
                del by_reason[old]
            by_reason[s["reason"]] = by_reason.get(s["reason"], 0) + 1
            out["skipped"][k] = s
