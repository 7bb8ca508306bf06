"""Driver side of the fast path: read tasks submitted from the plan, results in plan order.

What is in flight while a trainer consumes epoch ``e`` (``W`` = the task window)::

    plan(e):    u0 u1 u2 | u3 u4 u5 u6 | u7 ... u_last | plan(e+1): v0 v1 ...
                consumed | in flight (W)|  not yet      |  submitted once u_last is, so the
                         |  on workers  |  submitted    |  next epoch starts warm

Units are plain Ray tasks (one per ~256 images, ~100 ms of work) rather than Ray Data
operators: the streaming executor ramps read concurrency up from one task at every epoch,
while a fixed window keeps every core decoding from the first unit. Results are taken in plan
order, so an epoch is reproducible and a resume position is one (unit, row) pair. A task whose
worker dies is retried by Ray and, being deterministic, yields the same rows: no id is lost
or repeated.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from raying.errors import ConfigError, RayingError, SupersededError
from raying.read.account import UnitAccount
from raying.read.spec import ReadSpec
from raying.read.stages import DEFAULT_STAGE_ROWS
from raying.read.task import iter_unit
from raying.sampling.plan import EpochPlan, ReadUnit

logger = logging.getLogger(__name__)

# Seconds a read error waits for the other read tasks in flight, to read their errors too.
DEFAULT_READ_OUT_S = 5.0
# Task retries when a worker process or node dies under a read task.
DEFAULT_TASK_MAX_RETRIES = 8
# Seconds an iteration waits on one block before it says so (and again each as long after):
# a read of storage that neither answers nor fails (an HDFS DataNode that hangs: Hadoop's
# client waits out its socket timeout, 60 s by default, replica after replica) would
# otherwise hold the epoch without a word.
STALL_WARN_S = 60.0
# Rows of the first block of an epoch's first window of units: the trainer's first batch
# waits for this many decodes, not a whole unit's (256 rows: ~0.2 s on one core at 256 px).
DEFAULT_FIRST_BLOCK_ROWS = 64
# An epoch's last units (one per task slot) run as this many slices each: an epoch ends when
# its last unit is read, and with whole units one core finishes up to a unit's time (~0.2 s)
# before the other, idle for that epoch. A later epoch has the previous one's read-ahead to
# make up for it; epoch 0 has none. Slices under TAIL_MIN_ROWS rows are not worth a task.
TAIL_SLICES = 4
TAIL_MIN_ROWS = 32

_remote_fn = None

CLOSED = ("the Pipeline was closed while this iterator ran: its reads stopped; build a new "
          "Pipeline (load_state_dict(...) of a state_dict() taken before close() continues "
          "where it stood)")
SUPERSEDED = ("this iterator was superseded: a newer iteration of the same Pipeline "
              "(iter_batches, iter_torch_batches, to_tf, iter_blocks) has started, and a "
              "Pipeline streams one iteration at a time. Finish or drop the old iterator "
              "before starting the next, or build a second Pipeline to iterate both")


def read_task(spec: ReadSpec, unit: ReadUnit, paths: list[str] | None, block_rows: int,
              first_block_rows: int | None = None):
    """The read task: a generator of (block, account), one per ``block_rows`` rows (the first
    one ``first_block_rows`` when given).

    Each yielded value is copied into the object store before the generator resumes, so the
    worker's output buffer is reused from block to block.
    """
    from raying.storage.errors import counted_retries

    # An error takes the unit's account with it: it carries the retries made since the last
    # block's account (``read_retries``), which the driver adds to the pipeline's.
    mark = counted_retries()
    try:
        for part in iter_unit(spec, unit, paths, block_rows=block_rows, reuse_output=True,
                              first_block_rows=first_block_rows):
            yield part
            mark = counted_retries()
    except RayingError as exc:
        exc.read_retries = counted_retries() - mark
        raise


def _remote():
    global _remote_fn
    if _remote_fn is None:
        import ray

        _remote_fn = ray.remote(read_task)
    return _remote_fn


class BlockStream:
    """Runs the units of epoch plans as Ray tasks with a bounded window, in plan order.

    Args:
        spec: what every task needs (a ReadSpec); put in the object store once.
        make_plan: ``epoch -> EpochPlan``.
        fill: completes a unit just before it is submitted (draws prioritized ids, paths).
        window: read tasks in flight at most.
        inflight_bytes: the decoded bytes (rows x size x size x 3) the units in flight may
            hold together, or None: a unit beyond it waits, unless fewer than
            ``min_window`` are in flight. Blocks of large units (Parquet row groups of
            1,024 rows are 150 MB at 224 px) would otherwise overflow the object store and
            spill to disk.
        min_window: units kept in flight whatever their bytes (enough to keep the cores
            this stream may use decoding).
        keep_warm: submit the next epoch's first units while the current one drains.
        task_options: Ray options of the read task (num_cpus, scheduling_strategy, ...).
        split_units: run units over their byte share, and an epoch's last units, as
            slices (below).

    With ``split_units``, a unit larger than its share of ``inflight_bytes``
    (``inflight_bytes / min_window``) runs as several tasks, each decoding a slice of its rows
    (a whole number of blocks, or a part of a block over that share: see ``_part_rows``). A
    window of Parquet row groups is 1,024 rows or more (150 MB
    at 224 px): ``min_window`` whole ones in flight, with the one being consumed, fill a
    512 MB store past Ray's spilling threshold (80 %), and Ray then writes blocks to disk and
    reads them back (W3 on 2 cores: "Spilled 367 MiB" in an epoch of 4.0 s against 1.7 s, in
    about half of the runs), on a single consumer as on the shards of Ray Train workers. Each
    slice reads the row groups its rows lie in, so a shuffled window is read once per slice
    (a few ms of Parquet per slice here against the decode's ~0.3 s). The plan, the delivery
    order and resume positions stay the unit's: slices
    are an execution detail, keyed ``(epoch, unit, part)``.

    An epoch's last units (once less than a unit per task slot is left after them) run as slices
    too, of about a quarter unit (``tail_rows``): the epoch ends when its last unit is read,
    and with whole units one core finished up to a unit's time before the other, idle for that
    epoch (working on the next one's). Epoch 0, with no read-ahead from an epoch before it,
    took ~0.2-0.3 s longer than a later one on 2 cores (W7, 10,000 images).
    """

    def __init__(self, spec: ReadSpec, *, make_plan: Callable[[int], EpochPlan],
                 fill: Callable[[ReadUnit], tuple[ReadUnit, list[str] | None]],
                 window: int, block_rows: int, keep_warm: bool = True,
                 task_options: dict[str, Any] | None = None,
                 inflight_bytes: int | None = None, min_window: int = 1,
                 split_units: bool = False) -> None:
        import ray

        self._spec_ref = ray.put(spec)
        # A stage sees a chunk's rows together (it may look across them, and one that draws
        # random numbers keys its generator by the chunk's ids); chunks start at multiples
        # of DEFAULT_STAGE_ROWS of the unit and end at block edges too, so a short first
        # block gives the same chunks as dataset(e)'s whole blocks only when every block
        # edge is such a multiple.
        self._short_first = not spec.stages or int(block_rows) % DEFAULT_STAGE_ROWS == 0
        # Any stage sees the rows of its calls together (a stage may look across them), so
        # a first block cut at whole batches still ends at a multiple of the chunk.
        self._aligned = bool(spec.stages)
        self._batch_rows: int | None = None  # the consumer's batch size, when it said
        self._make_plan = make_plan
        self._fill = fill
        self._window = max(1, int(window))
        self._budget = None if inflight_bytes is None else max(1, int(inflight_bytes))
        self._min_window = max(1, min(int(min_window), self._window))
        self._row_bytes = int(spec.transform.size) ** 2 * 3
        # Slices start at multiples of block_rows: the same stage calls as the whole unit's
        # where that is a multiple of the calls' rows (any stage: one that looks across a
        # call's rows would see other rows together, one with a generator other draws).
        self._part_rows = _part_rows(self._budget, self._min_window, self._row_bytes,
                                     int(block_rows),
                                     splittable=split_units and (
                                         not spec.stages
                                         or int(block_rows) % DEFAULT_STAGE_ROWS == 0))
        self._keep_warm = keep_warm
        self._block_rows = int(block_rows)
        # The epoch's last units are sliced for the cores to finish it together (slices
        # start at multiples of DEFAULT_STAGE_ROWS: the stages' chunks are the whole unit's).
        self._tail_ok = split_units and (not spec.stages
                                         or int(block_rows) % DEFAULT_STAGE_ROWS == 0)
        self._options = {"num_cpus": 1, "max_retries": DEFAULT_TASK_MAX_RETRIES,
                         # No generator backpressure: a paused generator keeps its CPU, and
                         # one nobody consumes (a pipeline dropped mid-epoch) would starve the
                         # next pipeline's reads. The window bounds memory instead.
                         "num_returns": "streaming",
                         **(task_options or {})}
        self._tail_slots = _task_slots(min_window, self._window,
                                       self._options_cpus(self._options))
        # (epoch, unit index, part) -> ObjectRef of (block, account), in submission order.
        self._inflight: collections.OrderedDict[tuple[int, int, int], Any] = (
            collections.OrderedDict())
        self._inflight_bytes: dict[tuple[int, int, int], int] = {}  # the same keys: bytes
        # Parts taken out of the window and being consumed (their tasks may still run).
        self._reading: dict[tuple[int, int, int], Any] = {}
        self._pending: collections.deque[ReadUnit] = collections.deque()
        # The filled parts of the unit being submitted: (part unit, its paths, part number).
        self._parts: collections.deque[tuple[ReadUnit, list[str] | None, int]] = (
            collections.deque())
        self._nparts: dict[tuple[int, int], int] = {}  # (epoch, unit) -> its parts
        self._pending_epoch: int | None = None
        self._next_epoch_plan: EpochPlan | None = None
        self._consuming: int | None = None  # the epoch being iterated: warm up only the next
        # One iteration at a time: a newer one supersedes the last (whose prefetch thread may
        # still be pulling); the lock keeps their steps on the shared state apart.
        self._lock = threading.RLock()
        self._generation = 0
        # Read tasks of a stopped epoch still running after the read-out wait: held, and their
        # errors read once they finish (freed unread, Ray prints each as "Unhandled error",
        # in the middle of whatever the user runs next).
        self._unread: list[tuple[tuple[int, int, int], Any, Any]] = []  # (key, task, bug)
        self._closed = False  # close(): iterators still running stop with CLOSED

    @staticmethod
    def _options_cpus(task_options: dict[str, Any] | None) -> float:
        cpus = (task_options or {}).get("num_cpus", 1)
        return float(cpus) if cpus is not None else 1.0

    def resize(self, window: int, inflight_bytes: int | None, min_window: int) -> None:
        """A new window (read tasks in flight), byte budget and least window, for the cluster
        as it is now: the parts submitted from now on keep to them (the tasks in flight
        run on)."""
        with self._lock:
            self._window = max(1, int(window))
            self._budget = None if inflight_bytes is None else max(1, int(inflight_bytes))
            self._min_window = max(1, min(int(min_window), self._window))
            self._tail_slots = _task_slots(min_window, self._window,
                                           self._options_cpus(self._options))
            if self._part_rows is not None:
                self._part_rows = _part_rows(self._budget, self._min_window, self._row_bytes,
                                             self._block_rows, splittable=True)

    # -- submission ----------------------------------------------------------------------------
    def _split(self, unit: ReadUnit) -> None:
        """Fill ``unit`` (ids drawn, paths found) and queue it as one part or, when its
        decoded rows exceed a unit's share of the byte budget, as row slices."""
        unit, paths = self._fill(unit)
        n, step = unit.num_rows, self._part_rows
        # The rest of its epoch is less than a unit like it per task slot. Parquet units
        # (no paths) are not: a slice reads every row group of its unit.
        slots = self._tail_slots
        if (self._tail_ok and slots > 1 and paths is not None and len(self._pending) <= slots
                and sum(u.num_rows for u in self._pending) < slots * n):
            tail = tail_rows(n, self._batch_rows)
            if tail is not None:
                step = tail if step is None else min(step, tail)
        if step is None or unit.skip_rows or unit.ids is None or n <= step:
            parts = [(unit, paths, 0)]
        else:
            parts = [(_slice_unit(unit, a, min(n, a + step)),
                      None if paths is None else paths[a:a + step], k)
                     for k, a in enumerate(range(0, n, step))]
        self._nparts[(unit.epoch, unit.index)] = len(parts)
        self._parts.extend(parts)

    def _submit(self, part: tuple[ReadUnit, list[str] | None, int]) -> None:
        unit, paths, k = part
        # The first window of an epoch yields a short first block (see __init__ for stages).
        first = (first_block_rows(self._batch_rows, unit.num_rows, aligned=self._aligned)
                 if k == 0 and unit.index < self._window and self._short_first else None)
        ref = _remote().options(**self._options).remote(self._spec_ref, unit, paths,
                                                         self._block_rows, first)
        key = (unit.epoch, unit.index, k)
        self._inflight[key] = ref
        self._inflight_bytes[key] = unit.num_rows * self._row_bytes

    def _room_for(self, rows: int) -> bool:
        """Whether a part of ``rows`` rows may start now under the byte budget."""
        if self._budget is None or len(self._inflight) < self._min_window:
            return True
        held = sum(self._inflight_bytes.values())
        return held + rows * self._row_bytes <= self._budget

    def _pop(self, key: tuple[int, int, int]) -> Any:
        self._inflight_bytes.pop(key, None)
        return self._inflight.pop(key, None)

    def _top_up(self) -> None:
        while len(self._inflight) < self._window:
            if not self._parts:
                if not self._pending:
                    if (not self._keep_warm or self._pending_epoch is None
                            or self._pending_epoch != self._consuming):  # one epoch ahead
                        return
                    nxt = self._pending_epoch + 1
                    plan = self._make_plan(nxt)
                    self._next_epoch_plan = plan
                    self._pending.extend(plan.units)
                    self._pending_epoch = nxt
                    if not self._pending:
                        return
                head = self._pending[0].num_rows
                if not self._room_for(head if self._part_rows is None
                                      else min(head, self._part_rows)):
                    return
                self._split(self._pending.popleft())
            if not self._room_for(self._parts[0][0].num_rows):
                return
            self._submit(self._parts.popleft())

    def _take(self, key: tuple[int, int, int]) -> Any:
        """The ref of part ``key``, submitting up to it when the window has not reached it."""
        ref = self._pop(key)
        while ref is None:
            if not self._parts:
                if not self._pending:
                    msg = f"read part {key} was neither submitted nor pending"
                    raise RuntimeError(msg)
                self._split(self._pending.popleft())
            self._submit(self._parts.popleft())
            ref = self._pop(key)
        return ref

    def _start(self, epoch: int, start_unit: int, skip_rows: int) -> EpochPlan:
        reuse = (self._pending_epoch == epoch and self._next_epoch_plan is not None
                 and self._next_epoch_plan.epoch == epoch and start_unit == 0 and skip_rows == 0)
        keys = list(self._inflight)
        self._consuming = epoch
        if reuse and (epoch, 0, 0) in keys:  # warm: already running
            # What a consumer that stopped inside an earlier epoch left submitted or being
            # read goes, as a cancel would drop it (a kept ref pins its unread blocks in the
            # store), whether or not its iteration has let go of it yet.
            for key in [k for k in keys if k[0] != epoch]:
                self._pop(key)
            for key in [k for k in self._reading if k[0] != epoch]:
                del self._reading[key]
            for part in [k for k in self._nparts if k[0] != epoch]:
                del self._nparts[part]
            self._parts = collections.deque(p for p in self._parts if p[0].epoch == epoch)
            return self._next_epoch_plan  # type: ignore[return-value]
        self.cancel()  # (keeps _consuming)
        plan = self._make_plan(epoch)
        units = [u for u in plan.units if u.index >= start_unit]
        if units and skip_rows:
            units[0].skip_rows = skip_rows
        self._pending = collections.deque(units)
        self._pending_epoch = epoch
        self._next_epoch_plan = plan
        return plan

    def prefetch(self, epoch: int) -> bool:
        """Submit the first window of ``epoch`` now, before anyone iterates it (a Train worker
        building its model meanwhile): the first read tasks start their worker processes and
        decode while nothing waits. An :meth:`iter_epoch` of ``epoch`` from its start takes
        the running reads; of another epoch or position, drops them. Nothing is submitted
        when reads already run or wait; returns whether this call submitted."""
        with self._lock:
            if self._inflight or self._reading or self._pending or self._parts:
                return False
            self._start(int(epoch), 0, 0)
            self._consuming = None  # no consumer yet: the next epoch is not warmed early
            self._top_up()
            return bool(self._inflight)

    def set_batch_rows(self, rows: int | None) -> None:
        """The consumer's batch size: the short first blocks of the units submitted from now
        on hold whole batches (see :func:`first_block_rows`)."""
        with self._lock:
            self._batch_rows = None if rows is None else max(1, int(rows))

    # -- consumption ---------------------------------------------------------------------------
    def iter_epoch(self, epoch: int, *, start_unit: int = 0, skip_rows: int = 0,
                   on_account: Callable[[UnitAccount], None] | None = None,
                   on_last_unit: Callable[[int, dict[int, int]], None] | None = None
                   ) -> Iterator[tuple[int, dict[str, np.ndarray], bool]]:
        """Yield ``(unit index, block, last block of the unit)`` for the units of ``epoch``
        from ``start_unit`` on; a unit yields one block per ``block_rows`` rows, in order.
        ``on_last_unit`` gets the index of the epoch's last unit (-1: none) and the rows
        planned for each unit from ``start_unit`` on (at most what it yields: bad samples
        are set aside), before any block."""
        import ray

        with self._lock:
            self._generation += 1
            mine = self._generation
            plan = self._start(epoch, start_unit, skip_rows)
        last = plan.units[-1].index if plan.units else -1
        if on_last_unit is not None:
            on_last_unit(last, {u.index: int(u.draw) - (skip_rows if u.index == start_unit
                                                          else 0)
                                for u in plan.units if u.index >= start_unit})
        index = start_unit
        try:
            while index <= last:
                if self._unread:
                    self._reap_unread()
                k = 0
                while True:  # the unit's parts, in order
                    if not ray.is_initialized():  # submitting would start a new Ray (auto-init)
                        raise ConfigError("Ray was shut down while this epoch was read")
                    with self._lock:
                        self._check(mine)
                        self._top_up()
                        key = (epoch, index, k)
                        ref = self._take(key)
                        self._reading[key] = ref
                        last_part = k + 1 >= self._nparts.get((epoch, index), 1)
                    for part in _parts(ref, (epoch, index), lambda: self._check(mine),
                                       self._options_cpus(self._options)):
                        try:
                            block, account = ray.get(part)
                        except ray.exceptions.RayTaskError as exc:
                            with self._lock:
                                if self._generation == mine:
                                    others = [(k, r) for k, r in (*self._inflight.items(),
                                                                  *self._reading.items())
                                              if r is not ref]
                                    self.cancel()
                                else:
                                    others = []
                            cause = getattr(exc, "cause", None)
                            more = _read_out_failures(
                                others, DEFAULT_READ_OUT_S, epoch=epoch, raised=cause,
                                left=lambda keyed, bug=cause: self._hold(keyed, bug))
                            if isinstance(cause, RayingError):
                                cause.read_retries = getattr(cause, "read_retries", 0) + more
                                raise cause from None
                            raise
                        with self._lock:
                            self._check(mine)
                        if account.final and not last_part:  # the unit goes on in the next part
                            account = dataclasses.replace(account, final=False)
                        if on_account is not None:
                            on_account(account)
                        yield index, block, account.final
                    with self._lock:
                        self._reading.pop(key, None)
                        self._check(mine)
                        if last_part:
                            self._nparts.pop((epoch, index), None)
                        self._top_up()
                    if last_part:
                        break
                    k += 1
                index += 1
        except GeneratorExit:
            # The consumer stopped early (a loop's break, a closed iterator): its epoch's
            # reads go now, as a new iteration would drop them; refs kept would pin their
            # blocks in the store until then, and keep prefetch() from starting an epoch.
            self._drop_epoch(epoch, mine)
            raise
        except ray.exceptions.RayError:
            # A read lost with its worker or node past Ray's retries (a read's own error is
            # handled above): the epoch stops, and its reads in flight go with it.
            with self._lock:
                if self._generation == mine:
                    self._cancel()
            raise

    def _drop_epoch(self, epoch: int, mine: int) -> None:
        """Drop what the stopped iteration ``mine`` of ``epoch`` left submitted or pending
        (the next epoch's warm reads stay, for its iteration to take); nothing once a newer
        iteration took over the stream."""
        with self._lock:
            if self._generation != mine:
                return
            for key in [k for k in self._reading if k[0] == epoch]:
                del self._reading[key]
            for key in [k for k in self._inflight if k[0] == epoch]:
                self._pop(key)
            for part in [k for k in self._nparts if k[0] == epoch]:
                del self._nparts[part]
            self._parts = collections.deque(p for p in self._parts if p[0].epoch != epoch)
            if self._pending_epoch == epoch:
                self._pending.clear()
                self._pending_epoch = None
                self._next_epoch_plan = None
            self._consuming = None

    def _hold(self, keyed: list[tuple[tuple[int, int, int], Any]], bug: Any) -> None:
        """Keep a stopped epoch's tasks that still ran after the read-out wait (with the error
        that stopped it) until they finish; a closed stream drops them."""
        with self._lock:
            if not self._closed:
                self._unread.extend((key, task, bug) for key, task in keyed)

    def _reap_unread(self) -> list[Any]:
        """Read out the held tasks that have finished since, as :func:`_read_out_failures`
        reads the others of a stopped epoch (each distinct error logged once); the rest
        stay held unless the stream is closed. Returns those still running."""
        import ray

        with self._lock:
            held, self._unread = self._unread, []
        if not held or not ray.is_initialized():
            return []
        try:
            done, _ = ray.wait([t.completed() for _, t, _ in held], num_returns=len(held),
                               timeout=0)
        except ray.exceptions.RayError:
            return []  # lost with their workers: nothing to read
        finished = {d.hex() for d in done}
        left = [(k, t, b) for k, t, b in held if t.completed().hex() not in finished]
        for key, task, bug in held:
            if task.completed().hex() in finished:
                _read_out_failures([(key, task)], 0.0, epoch=key[0], raised=bug)
        with self._lock:
            if not self._closed:
                self._unread = left + self._unread
        return [t for _, t, _ in left]

    def _check(self, mine: int) -> None:
        if self._generation != mine:
            if self._closed:
                raise ConfigError(CLOSED)
            raise SupersededError(SUPERSEDED)

    def cancel(self, *, supersede: bool = False) -> None:
        """Drop every submitted and pending unit (a different epoch or a resume was asked);
        ``supersede``: an iteration still running stops at its next step with
        ``SupersededError`` (a resume point loaded under it)."""
        with self._lock:
            if supersede:
                self._generation += 1
            self._cancel()

    def _cancel(self) -> None:
        # The refs are dropped, not ray.cancel()ed: cancelling a streaming read task as it
        # completes aborts the driver in Ray 2.60 ("Tried to complete task that was not
        # pending", task_manager.cc; 3 of 6 runs of 300 break-and-close loops). The tasks
        # in flight (at most a window of units) finish on their own and their blocks are freed.
        self._inflight.clear()
        self._inflight_bytes.clear()
        self._reading.clear()  # a dropped generator's ref would pin its blocks in the store
        self._pending.clear()
        self._parts.clear()
        self._nparts.clear()
        self._pending_epoch = None
        self._next_epoch_plan = None

    def close(self) -> list[Any]:
        """Stop: an iterator still running stops at its next step, nothing more is submitted.
        Returns the read tasks that may still run (dropped, not cancelled: see ``_cancel``),
        for a caller that must wait for them, e.g. before removing files they write."""
        with self._lock:
            self._generation += 1
            self._closed = True
            running = [*self._inflight.values(), *self._reading.values()]
            self._cancel()
        # The held tasks still running: for the caller to wait for, then dropped.
        return running + self._reap_unread()

    def wait_done(self, tasks: list[Any], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``tasks`` (from :meth:`close`) to finish; True when
        they all did."""
        import ray

        if not tasks or not ray.is_initialized():
            return True
        done = [t.completed() for t in tasks]
        try:
            ready, _ = ray.wait(done, num_returns=len(done), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a task that failed has finished all the same
            return False
        return len(ready) == len(done)


def _parts(ref: Any, waited: tuple[int, int] | None = None,
           current: Callable[[], None] | None = None, task_cpus: float = 1.0
           ) -> Iterator[Any]:
    """The parts of a read task's generator, each asked for only while Ray is up: a call on
    it after ``ray.shutdown()`` (this runs on a reader thread, the training thread may shut
    Ray down meanwhile) would start a new Ray from this thread (Ray's auto-init), which
    later aborts the process. With ``waited`` (the epoch and unit), a part waited on for
    ``STALL_WARN_S`` is said in a warning, and again each ``STALL_WARN_S`` after, while
    ``current()`` does not raise (it does once the pipeline closed or a newer iteration
    took over: this one's wait ends there, unsaid). ``task_cpus`` is what a read task asks
    for, to say when the cluster has no such room."""
    import time

    import ray

    it = iter(ref)
    while True:
        if not ray.is_initialized():
            raise ConfigError("Ray was shut down while this epoch's blocks were read")
        if waited is not None:
            # Ready once the next part is stored, or the task ended (its end or its error).
            began = time.monotonic()
            while not ray.wait([ref], timeout=STALL_WARN_S, fetch_local=False)[0]:
                if current is not None:
                    current()
                _say_stall(waited, time.monotonic() - began, task_cpus)
                if not ray.is_initialized():
                    raise ConfigError("Ray was shut down while this epoch's blocks were read")
        try:
            part = next(it)
        except StopIteration:
            return
        yield part


def _say_stall(waited: tuple[int, int], seconds: float, task_cpus: float) -> None:
    """The warning of a block waited on for ``seconds``: the cause when it can be seen (no
    CPU left for a read task beside the placement groups, as Train workers that take every
    CPU leave on a cluster no autoscaler grows), else the causes that look the same."""
    from raying.engine.ray_setup import cpus_outside_placement_groups

    epoch, unit = waited
    try:
        free = cpus_outside_placement_groups()
    except Exception:  # noqa: BLE001 - shut down meanwhile: the general line
        free = None
    if free is not None and free < task_cpus:
        logger.warning(
            "raying: epoch %d has waited %.0f s for a block of its read unit %d, whose read "
            "task may never start: the cluster has %.2f CPU beside what its placement groups "
            "reserve (Ray Train's workers hold theirs in one), and each read task needs %s. "
            "Unless an autoscaler adds a node, give the workers fewer CPUs "
            "(ScalingConfig(resources_per_worker={'CPU': ...})) or the reads fewer "
            "(PipelineConfig(task_num_cpus=...)); it goes on waiting", epoch, seconds, unit,
            free, task_cpus)
        return
    logger.warning(
        "raying: epoch %d has waited %.0f s for a block of its read unit %d, whose read task "
        "has not finished; it goes on waiting. A read of storage that neither answers nor "
        "fails holds a read this long (an HDFS DataNode that hangs: Hadoop's client waits out "
        "dfs.client.socket-timeout, 60 s by default, per replica); so does a user stage that "
        "blocks", epoch, seconds, unit)


def _read_out_failures(keyed: list[tuple[tuple[int, int, int], Any]], timeout_s: float, *,
                       epoch: int = -1, raised: BaseException | None = None,
                       left: Callable[[list[tuple[tuple[int, int, int], Any]]], None]
                       | None = None) -> int:
    """After a read error (``raised``) stopped ``epoch``: wait up to ``timeout_s`` for the
    other dropped tasks (``keyed`` by (epoch, unit, part); at most a window of units) and read
    each one's parts, logging the errors of those that failed too, each once, with the epoch
    it was read for (the next epoch's first units are read ahead). The same user function
    failing again is the raised error's bug: counted, not logged again. Read, their errors
    are handled; freed unread, Ray would print each as an "Unhandled error" traceback. Tasks
    still running after ``timeout_s`` are dropped unread, or handed to ``left`` (with their
    keys) to be read out the same way once they finish. Done before the first error is
    raised, in this thread; the tasks handed to ``left`` are read out the same way by the
    stream once they finish (at its next unit, or at its close, which returns those still
    running for the pipeline to wait for).
    Returns the read retries the failed ones made (their accounts are lost with them)."""
    import ray

    retries = 0
    if not keyed:
        return retries
    tasks = [t for _, t in keyed]
    epochs = {id(t): k[0] for k, t in keyed}
    same_bug = getattr(raised, "function", None)
    try:
        done, _ = ray.wait([t.completed() for t in tasks], num_returns=len(tasks),
                           timeout=timeout_s)
    except ray.exceptions.RayError:
        return retries  # a task lost with its worker: nothing more to read here
    finished = {d.hex() for d in done}
    if left is not None:
        left([(k, t) for k, t in keyed if t.completed().hex() not in finished])
    # Each distinct error once, with how many parts had it: by (its epoch, text).
    failed: dict[tuple[int, str], int] = {}
    try:
        for task in tasks:
            try:
                if task.completed().hex() not in finished:
                    continue
                for part in _parts(task):  # a finished task's parts are all there
                    try:
                        ray.get(part)
                    except ray.exceptions.RayError as exc:
                        cause = getattr(exc, "cause", None)
                        retries += int(getattr(cause, "read_retries", 0))
                        if same_bug is not None and getattr(cause, "function", None) == same_bug:
                            continue
                        key = (epochs.get(id(task), epoch), str(cause or exc))
                        failed[key] = failed.get(key, 0) + 1
            except Exception:  # noqa: BLE001 - Ray itself gone: nothing left to read
                logger.debug("a dropped read task not read out", exc_info=True)
                if not ray.is_initialized():
                    return retries
    finally:
        for (of, text), count in failed.items():
            times = f" ({count} times)" if count > 1 else ""
            which = (f"of the stopped epoch {of}" if of == epoch
                     else f"of epoch {of}, read ahead,")
            logger.warning("another read task %s failed too%s: %s", which, times, text)
    return retries


def first_block_rows(batch_rows: int | None, unit_rows: int, *, aligned: bool) -> int | None:
    """Rows of the short first block of an epoch's first units, or None for none.

    ``DEFAULT_FIRST_BLOCK_ROWS`` rounded up to whole batches of ``batch_rows``: a first block
    that ends inside a batch makes that batch straddle two blocks, and a straddling batch is
    copied. None when that is the whole unit (a batch of 256 waits for 256 decodes however
    the unit is cut). ``aligned``: the block must end at a multiple of DEFAULT_STAGE_ROWS
    (user stages run on chunks of that many rows of the unit: a stage may look across a
    call's rows, and one that draws random numbers keys them by the chunk); a batch size
    that does not allow it keeps DEFAULT_FIRST_BLOCK_ROWS.
    """
    rows = DEFAULT_FIRST_BLOCK_ROWS
    if batch_rows:
        whole = -(-rows // batch_rows) * batch_rows
        if not aligned or whole % DEFAULT_STAGE_ROWS == 0:
            rows = whole
    if aligned and rows % DEFAULT_STAGE_ROWS:
        return None
    return rows if rows < unit_rows else None


def tail_rows(unit_rows: int, batch_rows: int | None) -> int | None:
    """Rows of each slice of one of an epoch's last units, or None to read it whole: about
    ``1 / TAIL_SLICES`` of it, a multiple of DEFAULT_STAGE_ROWS (the stages' chunks stay the
    whole unit's) and of the consumer's batch where that still cuts the unit in halves or
    finer (a batch that straddles two slices is copied), at least ``TAIL_MIN_ROWS``; None
    for a unit under two such slices."""
    if unit_rows < 2 * TAIL_MIN_ROWS:
        return None
    want = -(-unit_rows // TAIL_SLICES)
    rows = -(-want // DEFAULT_STAGE_ROWS) * DEFAULT_STAGE_ROWS
    if batch_rows and batch_rows % DEFAULT_STAGE_ROWS == 0:
        whole = -(-want // batch_rows) * batch_rows
        if 2 * whole <= unit_rows:
            rows = whole
    rows = max(TAIL_MIN_ROWS, rows)
    return rows if rows < unit_rows else None


def _task_slots(min_window: int, window: int, task_cpus: float) -> int:
    """Read tasks of a stream that run at once: its cores (``min_window`` is one per core it
    may use, plus the one being consumed) over each task's CPUs, at most its window."""
    cores = max(1, int(min_window) - 1)
    return max(1, min(int(window), int(cores / task_cpus) if task_cpus > 0 else cores))


def _part_rows(budget: int | None, min_window: int, row_bytes: int, block_rows: int, *,
               splittable: bool) -> int | None:
    """Rows of one part of a unit: the most whole blocks within a unit's share of the byte
    budget, or None when units are never split.

    A block over that share stays whole while ``min_window`` whole blocks fit in twice the
    budget (the whole object store, at the default share of a half): a Train worker's shard
    of a 256 MB store keeps two 38.5 MB blocks (224 px) against its 64 MB budget; read as
    halves, the Train path ran at 0.81 of the iterator against 0.94 whole (W1, 2 cores).
    Beyond that a part is the largest half, quarter, ... of a block of which ``min_window``
    fit in twice the budget, at least ``DEFAULT_STAGE_ROWS`` and rounded up to a multiple of
    it (the stages' chunks stay the unit's). At 384 px (113 MB a 256-row block) the
    iterator on 2 cores kept three whole blocks in flight on a 256 MB store and spilled
    0.2-1.2 GB to disk in 4 epochs of 10,000 images; as halves it spilled nothing and read
    epoch 0 1.2-1.6x as fast, later epochs as fast."""
    if budget is None or not splittable:
        return None
    row_bytes, block_rows = max(1, row_bytes), max(1, block_rows)
    share = budget // max(1, min_window)
    blocks = share // row_bytes // block_rows
    if blocks >= 1:
        return blocks * block_rows
    if max(1, min_window) * block_rows * row_bytes <= 2 * budget:
        return block_rows
    rows = block_rows
    while rows > DEFAULT_STAGE_ROWS and max(1, min_window) * rows * row_bytes > 2 * budget:
        rows = -(-rows // 2)
    return min(block_rows, -(-rows // DEFAULT_STAGE_ROWS) * DEFAULT_STAGE_ROWS)


def _slice_unit(unit: ReadUnit, a: int, b: int) -> ReadUnit:
    """Rows ``[a, b)`` of a filled unit, as a unit of their own (same epoch and index)."""
    def cut(v: Any) -> Any:
        return None if v is None else v[a:b]

    return dataclasses.replace(unit, draw=b - a, ids=cut(unit.ids), labels=cut(unit.labels),
                               probs=cut(unit.probs), weights=cut(unit.weights),
                               occurrence=cut(unit.occurrence))
