"""The Pipeline: manifest + sampler + transform -> Ray Data datasets and framework batches.

What is in flight for ``pipe.iter_torch_batches(epoch=e)``::

    sampler.plan(e) -> units u0..uK          (ids grouped by file / row group)
    BlockStream      -> W read tasks on the cluster: read + decode + augment fused, uint8
    prefetch thread  -> P batches sliced, converted to tensors, copied to the device
    trainer          -> batch; pipe.report(ids, losses) -> priority store (prioritized)
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from raying.dataset.manifest import Manifest
from raying.engine.datasource import DatasetReads, merge_dataset_account
from raying.engine.metrics import EpochTally, RunAccount
from raying.engine.ray_setup import ensure_ray, ray_session
from raying.engine.stream import CLOSED, SUPERSEDED
from raying.errors import ConfigError, SupersededError, UserFunctionError
from raying.image.transform import ImageTransform
from raying.loader.batches import BatchAssembler, TorchConverter, prefetch
from raying.loader.owners import claim_sampler
from raying.options import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_INFLIGHT_STORE_SHARE,
    PipelineConfig,
    Settings,
    epoch_block_rows,
    use,
)
from raying.read.account import UnitAccount
from raying.read.memory import Footprint, dir_bytes, own_kib
from raying.read.spec import ReadSpec, dataset_key
from raying.read.stages import (
    StageChain,
    UserStage,
    check_stage,
    column_template,
    columns_problem,
    stage_names,
)
from raying.sampling.plan import EpochPlan, ManifestLookup, ReadUnit
from raying.sampling.protocol import Sampler
from raying.sampling.uniform import UniformSampler

_ON_ERROR = ("skip", "raise")
# How long close() waits for read tasks still running before it removes the decoded cache.
DEFAULT_CLOSE_WAIT_S = 30.0
# Seconds between two looks at the cluster's size within an epoch (one
# ``ray.cluster_resources()`` call): nodes an autoscaler adds in the middle of a long epoch
# (an ImageNet epoch lasts tens of minutes) get read tasks then, not at the next epoch.
WINDOW_REFIT_S = 10.0

logger = logging.getLogger(__name__)


# state_dict's format: 2 since uniform Parquet plans deal windows over ~1/8 of an epoch into
# parts (a version-1 position inside such an epoch points into another plan).
STATE_VERSION = 2


class _DefaultEpoch(int):
    """Epoch 0 as the iterators' default, told apart from an ``epoch=0`` passed."""

    def __repr__(self) -> str:
        return "0"


FIRST_EPOCH = _DefaultEpoch(0)


class Pipeline:
    """Streams a manifest's samples, sampled and augmented, into Ray Data, torch and tf.

    Args:
        manifest: the dataset (:meth:`raying.Manifest.scan`).
        transform: decode-side augmentation; default ``ImageTransform()`` (224, training).
        sampler: ``UniformSampler`` (default), ``PrioritizedSampler``, ``InfoBatchSampler`` or
            ``WeightedSampler``.
        on_error: ``"skip"`` sets bad samples aside and reports them (``stats()["skipped"]``);
            ``"raise"`` stops at the first one with an error naming the file.
        config: a :class:`PipelineConfig`.
        settings: the ``RAYING_*`` defaults (:class:`raying.options.Settings`); None reads
            them from the environment now.
    """

    def __init__(self, manifest: Manifest, *, transform: ImageTransform | None = None,
                 sampler: Sampler | None = None, on_error: str = "skip",
                 config: PipelineConfig | None = None,
                 settings: Settings | None = None) -> None:
        if not isinstance(manifest, Manifest):
            msg = (f"Pipeline needs a raying.Manifest, got {type(manifest).__name__}; build one "
                   f"with raying.Manifest.scan(uri)")
            raise ConfigError(msg)
        if on_error not in _ON_ERROR:
            msg = f"on_error must be one of {_ON_ERROR}, got {on_error!r}"
            raise ConfigError(msg)
        for arg, value in (("transform", transform), ("sampler", sampler),
                           ("config", config), ("settings", settings)):
            if isinstance(value, type):  # the class itself: it failed later, inside Ray
                msg = (f"Pipeline({arg}=...) got the class {value.__name__}, not one of its "
                       f"objects: pass {arg}={value.__name__}(...)")
                raise ConfigError(msg)
        self.manifest = manifest
        self.transform = transform or ImageTransform()
        if sampler is not None and not isinstance(sampler, Sampler):
            msg = (f"Pipeline(sampler=...) must be a raying sampler (UniformSampler, "
                   f"PrioritizedSampler, or an object with the raying.sampling.protocol.Sampler "
                   f"methods), got {type(sampler).__name__}")
            raise ConfigError(msg)
        self.on_error = on_error
        self.config = config or PipelineConfig()
        # The RAYING_* environment, read once here; read tasks and the store get these values
        # (and the default sampler, built after, its Parquet window).
        self.settings = settings if settings is not None else Settings.from_env()
        use(self.settings)
        self.sampler: Sampler = sampler if sampler is not None else UniformSampler()
        self.name = self.config.name or f"raying-{uuid.uuid4().hex[:8]}"
        claim_sampler(self)
        store_options = getattr(self.sampler, "store_options", None)
        snapshots = (store_options.get("snapshot_uri") if isinstance(store_options, dict)
                     else getattr(store_options, "snapshot_uri", None))
        if snapshots and not self.config.name:
            # Snapshots are found by the store's name, which follows the pipeline's: under a
            # random name a resubmitted driver starts from the initial priorities instead.
            logger.warning("raying: StoreConfig(snapshot_uri=%r) keeps the priorities under "
                           "the pipeline's name, here the random %r: a resubmitted driver "
                           "finds them only under the same name; give PipelineConfig(name=...)",
                           snapshots, self.name)
        # The decoded cache's directory. A pipeline's own: its name and a suffix of its own,
        # since the read workers of this job keep a closed pipeline's cache open under its
        # directory until they see its tombstone, and a new pipeline of the same name (a
        # fixed PipelineConfig(name=...)) must find neither. A share of a sharded one (a Train
        # worker's): the name and the share, so that a restarted trainer takes its share's
        # directory up again, on every node, instead of leaving it behind until the job ends.
        shard = self.config.shard
        self._cache_name = (f"{self.name}-{uuid.uuid4().hex[:8]}" if shard is None
                            else f"{self.name}-{shard[0]}of{shard[1]}")
        self.account = RunAccount(manifest)
        self._stream = None
        # Where the consumer stands: units seen so far as (index, first row, end row) and rows
        # delivered in the epoch (``base`` of them before the first listed unit, on resume).
        self._cursor: dict[str, Any] = {"epoch": 0, "units": [], "delivered": 0, "base": 0}
        self._resume: tuple[int, int, int, int] | None = None
        self._iterations = 0  # consumers' iterations started (the latest streams)
        self._default_passes = 0  # whole passes of an iterator called without epoch=
        self._said_default = False
        # Prefetch threads of iterations stopped early, still waiting on a read in flight:
        # close() waits for them, since a thread inside Ray's core when Ray shuts down
        # aborts the process.
        self._left_running: list[threading.Thread] = []
        # The prefetch threads of iterations still held by a consumer (stop event, thread).
        self._live_prefetch: set[tuple[threading.Event, threading.Thread]] = set()
        self._ray: str | None = None  # the Ray session the reads, store and refs belong to
        self._bound = False
        self._closed = False
        self._warned_empty_share = False
        self._dataset_aside: set[int] = set()  # dataset reads' set-asides handed to the sampler
        self._dataset_reads: DatasetReads | None = None  # once dataset() ran
        self._dataset_lock = threading.Lock()  # one account actor, however many threads ask
        self._sized_for: tuple[int, int] | None = None  # (CPUs, store bytes) the window fits
        self._lookup: ManifestLookup | None = None
        self._spec_ready = False
        self._footprint = Footprint()  # this node's tmpfs before the pipeline's first read
        self._stages: tuple[UserStage, ...] = ()
        self._spec = ReadSpec.of(manifest, self.transform, self.sampler.seed,
                                 on_error, max_pixels=self.config.max_image_pixels,
                                 settings=self.settings,
                                 io=self.config.io)
        if self._spec.io is not None and self._spec.io.cache is not None:
            self._spec.io.cache.check_dirs()

    # -- user stages ---------------------------------------------------------------------------
    def map_batches(self, fn: Callable[..., Any], *, with_rng: bool = False,
                    fn_kwargs: dict[str, Any] | None = None) -> Pipeline:
        """A pipeline that also runs ``fn`` on every batch, inside the read tasks.

        ``fn(batch, **fn_kwargs)`` takes and returns a dict of numpy arrays (up to 16 rows of
        a read block per call; see :mod:`raying.read.stages`): ``image`` (uint8
        NHWC, after decode and the built-in transform), ``label``, ``id``, ``weight``,
        ``prob`` and the manifest's extra columns. It may change values and add columns; it
        must keep the rows (``id`` as given, every column one row per id), ``image`` uint8
        ``(n, size, size, 3)``, a numeric ``label`` (its dtype and shape may change: soft
        labels) and one number per row in ``weight`` and ``prob`` (cast back to float32 and
        float64), and return the same columns for every batch. It runs in the read workers
        on every path (``iter_*``, ``to_tf`` and ``dataset(e)``), after the stages added
        before it.

        With ``with_rng=True`` it is called as ``fn(batch, rng=generator)``: a
        ``numpy.random.Generator`` derived from (sampler seed, epoch, the stage's position,
        the batch's ids), so an epoch is reproducible and a retried or resumed read task
        yields the same pixels (under the same ``block_rows``, which decides the rows each
        call gets). Draw every random number from it.

        If ``fn`` raises, the iteration stops with a :class:`raying.errors.UserFunctionError`
        naming ``fn``, the epoch and the batch's ids, with ``fn``'s traceback; ``on_error=
        "skip"`` does not hide it (it sets aside bad data, not bugs).

        Read workers import what ``fn`` needs when they unpickle it: a function that uses
        torch makes each read worker import torch (hundreds of MB per worker); plain numpy
        costs nothing more.

        Args:
            fn: the function; it must pickle (Ray ships it to the workers).
            with_rng: pass ``rng=`` as above.
            fn_kwargs: more keyword arguments for every call.

        Returns:
            A new Pipeline with this stage appended. This one is unchanged; the new one
            shares its manifest, transform, config, settings and its sampler object (and so
            a prioritized sampler's priority store): iterate one of them, not both. Call it
            before iterating (a started pipeline refuses it).
        """
        if self._closed or self._bound or self._stream is not None:
            msg = (f"map_batches on Pipeline {self.name!r} after it started (or closed); "
                   f"expected a pipeline that has not read yet: chain map_batches right after "
                   f"Pipeline(...), before iterating, before load_state_dict() and report() "
                   f"(they start it), so the sampler is bound once")
            raise ConfigError(msg)
        if not callable(fn):
            msg = f"map_batches needs a function of the batch dict, got {type(fn).__name__}"
            raise ConfigError(msg)
        if not isinstance(with_rng, bool):
            msg = f"with_rng must be True or False, got {with_rng!r}"
            raise ConfigError(msg)
        if fn_kwargs is not None and not isinstance(fn_kwargs, Mapping):
            msg = (f"fn_kwargs must be a dict of keyword arguments for fn, got "
                   f"{type(fn_kwargs).__name__} {fn_kwargs!r}")
            raise ConfigError(msg)
        kwargs = dict(fn_kwargs or {})
        if not all(isinstance(k, str) for k in kwargs):
            msg = f"fn_kwargs must have string keys, got {list(kwargs)}"
            raise ConfigError(msg)
        if with_rng and "rng" in kwargs:
            msg = ("fn_kwargs has 'rng', which with_rng=True passes itself; drop it from "
                   "fn_kwargs or pass with_rng=False")
            raise ConfigError(msg)
        stage = UserStage(fn, with_rng=with_rng, fn_kwargs=tuple(kwargs.items()))
        check_stage(stage)
        # The same name: a prioritized sampler, shared, binds both to one priority store.
        out = Pipeline(self.manifest, transform=self.transform, sampler=self.sampler,
                       on_error=self.on_error,
                       config=dataclasses.replace(self.config, name=self.name),
                       settings=self.settings)
        out._stages = (*self._stages, stage)
        out._spec = dataclasses.replace(out._spec, stages=StageChain(out._stages))
        return out

    @property
    def stages(self) -> tuple[UserStage, ...]:
        """The ``map_batches`` stages the read tasks run after the transform, in order."""
        return self._stages

    # -- plans ---------------------------------------------------------------------------------
    def _bind(self) -> None:
        if self._closed:
            store = (" and its sampler let go of its priority store"
                     if self.sampler.uses_store else "")
            msg = (f"Pipeline {self.name!r} is closed: its reads stopped{store}; build a new "
                   f"Pipeline (load_state_dict(...) of a state_dict() taken before close() "
                   f"continues where it stood)")
            raise ConfigError(msg)
        if not self._bound:
            claim_sampler(self)  # again: the pipeline it was given to first may have bound since
            if self.sampler.lazy or self.sampler.uses_store:
                self._start_ray()
            self.sampler.bind(self.manifest, name=self.name)
            self._bound = True

    def _start_ray(self) -> None:
        """Start (or attach to) Ray, and note the session this pipeline's reads belong to."""
        ensure_ray()
        self._ray = self._ray or ray_session()

    def _session_ended(self) -> bool:
        """Whether Ray was shut down (and maybe started again) since this pipeline started it."""
        return self._ray is not None and ray_session() != self._ray

    def _same_ray(self, hint: str = "") -> None:
        """Refuse to go on after Ray was shut down (and maybe started again) under this
        pipeline: its read tasks, priority store and object references went with the old
        session; touching them aborts the process in Ray's core, or makes Ray start a new
        local session of its own (which the user's next ray.init() then collides with)."""
        if self._session_ended():
            raise self._ended_error(hint)

    def _ended_now(self) -> ConfigError | None:
        """The ended-session error while waiting on the reader thread, None while Ray is up:
        a read the thread waits on inside Ray may never return once Ray is shut down; the
        closed error once the pipeline is closed (close() stops the thread)."""
        if self._closed:
            return ConfigError(CLOSED)
        try:
            ended = self._session_ended()
        except Exception:  # noqa: BLE001 - Ray shut down between its own checks: ended
            ended = self._ray is not None
        return self._ended_error() if ended else None

    def _ended_error(self, hint: str = "") -> ConfigError:
        try:
            again = ray_session() is not None
        except Exception:  # noqa: BLE001 - shut down while asked
            again = False
        since = "ray.shutdown() and ray.init()" if again else "ray.shutdown()"
        msg = (f"Pipeline {self.name!r} was started on a Ray session that has ended ({since} "
               f"since): its reads, priority store and object references went with it. "
               f"Build a new Pipeline after ray.init() (load_state_dict(...) of a "
               f"state_dict() taken before continues where it stood){hint}")
        return ConfigError(msg)

    def plan(self, epoch: int) -> EpochPlan:
        """The explicit plan of ``epoch`` (units of ids; prioritized units are drawn later)."""
        self._same_ray()
        self._bind()
        self._hand_dataset_asides()
        plan = self.sampler.plan(self.manifest, _epoch(epoch), block_rows=self.block_rows())
        if self.config.shard is None:
            return plan
        index, count = self.config.shard
        # This pipeline's share: every count-th unit, renumbered so that resume positions and
        # the stream's order refer to the share (the same for a restarted trainer).
        mine = [dataclasses.replace(u, index=k)
                for k, u in enumerate(plan.units[index::count])]
        return dataclasses.replace(plan, units=mine)

    def _hand_dataset_asides(self) -> None:
        """Samples that ``dataset(e)``'s reads set aside leave the plans made from now on, on
        either path, as the iterator's own set-asides do (a sampler that draws lazily gets
        them through its store instead; a share of a sharded pipeline keeps cutting the plan
        every share cuts)."""
        reads = self._dataset_reads
        if reads is None or self.sampler.lazy or self.config.shard is not None:
            return
        fresh = set(reads.skipped_ids()) - self._dataset_aside
        if fresh:
            self._dataset_aside |= fresh
            self.sampler.set_aside(sorted(fresh))

    def block_rows(self) -> int:
        """Rows per read task (and per block): ``config.block_rows``, or for a small epoch (under
        8 blocks) a multiple of 32 that cuts it into ~8 tasks, so it still spreads over the
        cores. Batches of a size that divides the block are zero-copy views; others straddle
        blocks and are copied. It depends only on the dataset, so a resumed run cuts its
        epochs the same way on any cluster."""
        rows = self.sampler.samples_per_epoch or len(self.manifest)
        return epoch_block_rows(rows, self.config.block_rows or self.settings.block_rows)

    def _fill(self, unit: ReadUnit) -> tuple[ReadUnit, list[str] | None]:
        if self._lookup is None:
            self._lookup = ManifestLookup(self.manifest)
        return self._lookup.complete(self.sampler.fill(unit))

    def _ready_spec(self) -> ReadSpec:
        """The read spec with what is resolved once, in the driver: the decoded-cache budget."""
        if not self._spec_ready:
            from raying.read import decoded_cache as decoded
            from raying.read import decoded_dirs

            def size_of(ids):
                return decoded.header_sizes(self.manifest, ids)

            shard = self.config.shard  # each share caches a copy, maybe on the same node
            budget = decoded.plan_budget(self.config.decoded_cache, self.manifest,
                                         size_of=size_of, epochs=self.config.epochs,
                                         copies=1 if shard is None else shard[1])
            admit = 1.0  # "auto" is on only when the whole decoded set fits
            if budget and self.config.decoded_cache != "auto":
                admit = decoded.admit_share(budget, self.manifest, size_of)
            owner = decoded_dirs.owner_id()
            if budget:
                decoded_dirs.claim(self._cache_name, owner)
                # A pipeline dropped without close() frees this node's decoded pixels when it
                # is collected (tmpfs is memory), not only when the process exits.
                weakref.finalize(self, decoded_dirs.release, self._cache_name)
            else:  # what crashed drivers' pipelines left goes all the same
                decoded_dirs.sweep_leftovers()
            self._spec = dataclasses.replace(self._spec, decoded_cache_bytes=budget,
                                             decoded_cache_name=self._cache_name,
                                             decoded_cache_auto=self.config.decoded_cache == "auto",
                                             decoded_cache_owner=owner,
                                             decoded_cache_admit=admit,
                                             decoded_cache_fill=self.config.decoded_cache_fill,
                                             cache_namespace=dataset_key(
                _files_key(self.manifest), self._spec.storage))
            self._spec_ready = True
        return self._spec

    def _window(self, resources: dict[str, float]) -> tuple[int, int | None, int]:
        """(read tasks in flight, decoded bytes in flight, the least window) for a cluster of
        ``resources``."""
        cpus = int(resources.get("CPU", 1))
        shards = self.config.shard[1] if self.config.shard else 1
        window = self.config.window
        if window is None:
            # Per core this stream may use: a Train worker's shard queues for its share of
            # the cores only. Shards queueing for every core made the tasks of a worker
            # that ran ahead hold the cores the one behind waited for, and data-parallel
            # workers advance in step (W2 through Ray Train: 1,449-2,227 img/s against
            # 2,110-2,498 with the shares, two rounds each).
            window = max(2, self.settings.inflight_tasks_per_cpu * -(-cpus // shards))
        # Decoded bytes in flight: a share of the object store, split between the
        # streams that share it (a Train worker's shard); at least one unit per core
        # this stream may use, plus the one being consumed.
        store = resources.get("object_store_memory")
        inflight_bytes = (int(store * DEFAULT_INFLIGHT_STORE_SHARE / shards)
                          if store else None)
        return window, inflight_bytes, -(-cpus // shards) + 1

    def _block_stream(self):
        self._same_ray()
        if self._stream is None:
            import ray

            from raying.engine.stream import BlockStream

            self._start_ray()
            self._bind()
            resources = ray.cluster_resources()
            self._sized_for = _sizing(resources)
            window, inflight_bytes, min_window = self._window(resources)
            opts: dict[str, Any] = {"num_cpus": self.config.task_num_cpus}
            if self.config.spread:
                opts["scheduling_strategy"] = "SPREAD"
            opts.update(self.config.ray_remote_args or {})
            _warn_no_node_fits(float(opts.get("num_cpus") or 0.0))
            self._stream = BlockStream(self._ready_spec(), make_plan=self.plan, fill=self._fill,
                                       window=window, block_rows=self.block_rows(),
                                       keep_warm=self.config.keep_warm and not (
                                           # A plan made from the store's losses when its
                                           # epoch starts (InfoBatch) is not made early.
                                           self.sampler.uses_store and not self.sampler.lazy),
                                       task_options=opts,
                                       inflight_bytes=inflight_bytes, min_window=min_window,
                                       # Units over their byte share run as slices:
                                       # whole Parquet windows in flight spill the store.
                                       split_units=True)
        return self._stream

    def _fit_window(self, stream: Any) -> None:
        """Size the stream's window again when the cluster's CPUs or object store changed
        since it was sized (an autoscaler added nodes: a cluster that starts from a head of
        0 CPUs would keep a window of 2 read tasks for the whole run). Called as each epoch
        starts and every ``WINDOW_REFIT_S`` within it."""
        import ray

        if not ray.is_initialized():  # shut down under a running epoch: its next block says so
            return
        resources = ray.cluster_resources()
        sizing = _sizing(resources)
        if sizing == self._sized_for:
            return
        self._sized_for = sizing
        stream.resize(*self._window(resources))

    # -- iteration -----------------------------------------------------------------------------
    def _on_account(self, account: UnitAccount) -> None:
        fresh = self.account.add(account)
        # A bad sample must not keep drawing reads; but a share of a sharded pipeline (a Train
        # worker) leaves a sampler whose plans it shapes in this process alone (all but the
        # prioritized one, whose set-asides go to the shared store): the other shares never
        # see its skips, and every share must cut the same plan (its units r, r + W, ...).
        # There the bad samples are drawn and skipped again each epoch.
        if fresh and (self.config.shard is None or self.sampler.lazy):
            self.sampler.set_aside(fresh)

    def start(self, epoch: int | None = None) -> Pipeline:
        """Start Ray (if needed) and the priority store now, not at the first batch; with
        ``epoch``, that epoch's first reads too, so that its first batch is ready when the
        caller (building its model meanwhile) asks for it. The reads start at the first
        batch as usual where they cannot start early: when the state dict resumes that epoch
        mid-way, when reads of this pipeline already run, or when the sampler plans from the
        losses as the epoch starts (InfoBatch). Returns the pipeline."""
        stream = self._block_stream()
        if epoch is not None:
            epoch = _epoch(epoch)
            planned_at_start = self.sampler.uses_store and not self.sampler.lazy
            if (self._resume is None or self._resume[0] != epoch) and not planned_at_start:
                stream.prefetch(epoch)
        return self

    def iter_blocks(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The epoch's blocks in plan order (host numpy; image uint8 NHWC): an iteration as
        ``iter_batches`` is (the position moves with its rows; a newer one supersedes it)."""
        epoch = _epoch(epoch)
        self._block_stream()  # Ray started (if needed) by the caller's first next()
        mine = self._begin_iteration()
        for block in self._epoch_blocks(epoch, tail=0):
            self._still_current(mine)
            self._cursor["delivered"] += len(block["id"])
            self.account.delivered(len(block["id"]))
            yield block
        self._epoch_delivered(mine)

    def _epoch_blocks(self, epoch: int, *, tail: int,
                      counted: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """``iter_blocks`` for a batch iteration that drops a last batch of fewer than
        ``tail`` rows (``drop_last``; 0: none): once every block is in and fewer rows are
        left, the epoch is done for ``state_dict()``. ``counted=False`` reads without adding
        the reads' accounts or the blocks to ``stats()`` (a look ahead that no user gets)."""
        epoch = _epoch(epoch)
        stream = self._block_stream()
        start_unit, skip, base = 0, 0, 0
        if self._resume is not None and self._resume[0] == epoch:
            _, start_unit, skip, base = self._resume
        elif self._resume is not None and any(self._resume[1:]):
            # A loop whose epoch counter is off by one would lose the resume in silence.
            logger.warning("pipeline %s: the loaded state resumes epoch %d after %d rows, but "
                           "epoch %d was asked: it is read from its start and the resume "
                           "point is dropped; iterate epoch=state['epoch'] to continue where "
                           "the state stands", self.name, self._resume[0], self._resume[3],
                           epoch)
        self._resume = None
        self._fit_window(stream)
        fitted = time.monotonic()
        units: list[tuple[int, int, int, bool]] = []
        cursor = self._cursor = {"epoch": int(epoch), "units": units, "delivered": base,
                                 "base": base, "start": (start_unit, skip), "tail": tail}
        offset = {start_unit: skip}  # rows of each unit already accounted for
        tally = EpochTally(self._on_account if counted else lambda account: None)
        # The epoch's first block with rows, as empty columns of its dtypes and row shapes.
        keys: dict[str, np.ndarray] | None = None
        blocks = stream.iter_epoch(int(epoch), start_unit=start_unit, skip_rows=skip,
                                   on_account=tally.add,
                                   on_last_unit=lambda i, rows: cursor.update(
                                       last_unit=i, planned=rows))
        while True:
            # An iteration begun before ray.shutdown() and resumed after it would read the old
            # session's streams: Ray's core aborts the process on them once ray.init() ran
            # again, and fails with an AttributeError of its own before. Checked per block.
            self._same_ray()
            try:
                index, block, last = next(blocks)
            except StopIteration:
                break
            except Exception as exc:
                # The failed read tasks' retries, lost with their accounts (see read_task).
                self.account.retries += int(getattr(exc, "read_retries", 0) or 0)
                if self._session_ended():  # shut down while this block was being read
                    raise self._ended_error() from exc
                raise
            except SystemExit as exc:
                # Ray's core raises SystemExit(0) from a wait on a session shut down under
                # it: a training script would end as if it had finished.
                if self._session_ended():
                    raise self._ended_error() from exc
                raise
            if len(block["id"]):
                keys = self._same_columns(keys, block, int(epoch))
            if time.monotonic() - fitted >= WINDOW_REFIT_S:
                fitted = time.monotonic()
                self._fit_window(stream)
            begin = offset.get(index, 0)
            offset[index] = begin + len(block["id"])
            units.append((index, begin, begin + len(block["id"]), last))
            if counted:
                self.account.observe_block(int(epoch), block)
            yield block
        if not counted:
            return
        if cursor.get("last_unit") == -1 and self.config.shard is not None and not base:
            self._warn_empty_share(int(epoch))
        self.account.end_epoch(int(epoch))
        if not base:  # a resumed epoch delivered rows before its checkpoint: not all bad
            tally.refuse_all_bad(len(self.manifest), self.manifest.root, int(epoch))
        cursor["blocks_done"] = True  # every block of the epoch received

    def _warn_empty_share(self, epoch: int) -> None:
        """Say, once, that this share of a sharded epoch (a Train worker's) got no rows: the
        epoch has fewer read units than workers, and a loop whose steps wait for every
        worker (DDP's gradient all-reduce) would wait for this one."""
        if self._warned_empty_share:
            return
        self._warned_empty_share = True
        index, count = self.config.shard
        units = len(self.sampler.plan(self.manifest, epoch, block_rows=self.block_rows()).units)
        logger.warning("pipeline %s: worker %d of %d got no rows of epoch %d: the epoch has %d "
                       "read units of up to %d rows for %d workers, and each unit goes to one "
                       "worker. A loop whose steps wait for every worker (DDP) waits for this "
                       "one: use fewer workers, smaller units (PipelineConfig(block_rows=...)), "
                       "or DDP's model.join()", self.name, index, count, epoch, units,
                       self.block_rows(), count)

    def _depth(self, prefetch_batches: int | None) -> int:
        """Batches prepared ahead: ``prefetch_batches``, or the setting when None."""
        if prefetch_batches is None:
            return self.settings.prefetch_batches
        if (isinstance(prefetch_batches, bool)
                or not isinstance(prefetch_batches, (int, np.integer)) or prefetch_batches < 0):
            msg = (f"prefetch_batches must be an int >= 0 (0: none ahead) or None (the "
                   f"setting, RAYING_PREFETCH_BATCHES), got {prefetch_batches!r}")
            raise ConfigError(msg)
        return int(prefetch_batches)

    def _same_columns(self, keys: dict[str, np.ndarray] | None, block: dict[str, np.ndarray],
                      epoch: int) -> dict[str, np.ndarray]:
        """The block's columns (empty, of its dtypes and row shapes), checked against the
        epoch's first block's (:func:`raying.read.stages.columns_problem`)."""
        if keys is None:
            return column_template(block)
        problem = columns_problem(keys, block)
        if problem is not None:
            raise UserFunctionError(stage_names(self._spec.stages), epoch,
                                    block["id"], problem)
        return keys

    def _begin_iteration(self) -> int:
        """Number a consumer's iteration (iter_batches, iter_torch_batches)."""
        self._iterations += 1
        return self._iterations

    def _still_current(self, mine: int) -> None:
        """Refuse the batches an older iteration had prefetched once a newer one started:
        they would count in the newer one's position (a resume would skip their rows)."""
        if self._closed:
            raise ConfigError(CLOSED)
        if self._iterations != mine:
            raise SupersededError(SUPERSEDED)

    def _epoch_delivered(self, mine: int) -> None:
        """Iteration ``mine`` delivered its whole epoch: ``state_dict()`` moves on to the next,
        unless a newer iteration (or a loaded state) took over since, whose position it is."""
        if self._iterations == mine and not self._closed:
            self._cursor["complete"] = True

    def iter_batches(self, *, batch_size: int = DEFAULT_BATCH_SIZE,
                     epoch: int = FIRST_EPOCH,
                     prefetch_batches: int | None = None,
                     drop_last: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """numpy batches: ``id``, ``label``, ``image`` (uint8 NHWC), ``weight``, ``prob``, the
        manifest's extra columns and what ``map_batches`` stages added."""
        default = self._note_default_epoch(epoch, "iter_batches")
        epoch = _epoch(epoch)  # here, not in the prefetch thread
        assembler = BatchAssembler(batch_size, drop_last=drop_last)
        depth = self._depth(prefetch_batches)
        # Start Ray (if needed) here, not in the prefetch thread.
        self._block_stream().set_batch_rows(batch_size)

        def batches():
            for block in self._epoch_blocks(epoch, tail=batch_size if drop_last else 0):
                yield from assembler.push(block)
            yield from assembler.finish()

        mine = self._begin_iteration()
        for batch in prefetch(batches(), depth, stall=self.account.stall,
                              timed=self.account.iterated, left_running=self._left_running,
                              ended=self._ended_now, live=self._live_prefetch):
            self._still_current(mine)
            self._cursor["delivered"] += len(batch["id"])
            self.account.delivered(len(batch["id"]))
            yield batch
        self._epoch_delivered(mine)
        self._default_passes += default

    def iter_torch_batches(self, *, batch_size: int = DEFAULT_BATCH_SIZE,
                           epoch: int = FIRST_EPOCH,
                           device: Any = "auto",
                           prefetch_batches: int | None = None,
                           normalize: bool = True, drop_last: bool = False,
                           mean: tuple[float, float, float] | None = None,
                           std: tuple[float, float, float] | None = None,
                           pin_memory: bool | None = None) -> Iterator[dict[str, Any]]:
        """torch batches on ``device``: the batch contract (README, "torch").

        ``image`` is float32 NCHW normalized on the device (``normalize=True``), or uint8
        NHWC (``normalize=False``). ``id``/``label`` int64, ``weight`` float32, ``prob``
        float64. Extra columns are tensors where they hold numbers, else lists (one ``str``,
        ``bytes`` or 1-D tensor per row). ``pin_memory`` (default: on for a CUDA device)
        pins the host copy a CUDA transfer starts from; with ``device="cpu"`` there is no
        transfer and it does nothing.
        """
        from raying.options import DEFAULT_MEAN, DEFAULT_STD

        default = self._note_default_epoch(epoch, "iter_torch_batches")
        epoch = _epoch(epoch)  # here, not in the prefetch thread
        assembler = BatchAssembler(batch_size, drop_last=drop_last)
        depth = self._depth(prefetch_batches)
        conv = TorchConverter(device, normalize=normalize,
                              mean=DEFAULT_MEAN if mean is None else mean,
                              std=DEFAULT_STD if std is None else std, pin_memory=pin_memory)
        # Start Ray (if needed) here, not in the prefetch thread.
        self._block_stream().set_batch_rows(batch_size)

        def batches():
            for block in self._epoch_blocks(epoch, tail=batch_size if drop_last else 0):
                for b in assembler.push(block):
                    yield conv.device_put(conv.host(b))
            for b in assembler.finish():
                yield conv.device_put(conv.host(b))

        mine = self._begin_iteration()
        for batch in prefetch(batches(), depth, stall=self.account.stall,
                              timed=self.account.iterated, left_running=self._left_running,
                              ended=self._ended_now, live=self._live_prefetch):
            self._still_current(mine)
            n = int(batch["id"].shape[0])
            self._cursor["delivered"] += n
            self.account.delivered(n)
            yield batch
        self._epoch_delivered(mine)
        self._default_passes += default

    def _note_default_epoch(self, epoch: Any, method: str) -> bool:
        """Whether ``epoch`` is the iterators' default (not passed); after a whole pass of
        one, a second such pass says once that it reads epoch 0 again: a loop written for a
        DataLoader (a new shuffle each pass) would train on the same order and the same
        crops and flips every time."""
        default = type(epoch) is _DefaultEpoch
        if default and self._default_passes and not self._said_default:
            self._said_default = True
            warnings.warn(
                f"{method}() without epoch= reads epoch 0 again: the same order and the same "
                f"crops and flips as its pass before. Here the epoch number, not the pass, "
                f"reshuffles: pass epoch=e (for e in range(epochs)), or epoch=0 to read "
                f"epoch 0 again on purpose", UserWarning, stacklevel=3)
        return default

    def _first_batch(self, *, batch_size: int, epoch: int,
                     drop_last: bool) -> dict[str, Any] | None:
        """The first batch of ``epoch``, read to learn what the stages return. No user gets
        it: the position (``state_dict``, a loaded resume point) and ``stats()`` stay as they
        were (its reads are read again by the epoch's iteration, and counted there)."""
        epoch = _epoch(epoch)
        state, cursor, resume = self.account.delivery_state(), dict(self._cursor), self._resume
        self._block_stream().set_batch_rows(batch_size)
        self._begin_iteration()  # an older iteration's prefetched batches are refused
        assembler = BatchAssembler(batch_size, drop_last=drop_last)
        blocks = self._epoch_blocks(epoch, tail=batch_size if drop_last else 0, counted=False)
        try:
            for block in blocks:
                for batch in assembler.push(block):
                    return batch
            return next(iter(assembler.finish()), None)
        finally:
            blocks.close()
            self.account.restore_delivery(state)
            self._cursor, self._resume = cursor, resume

    def to_tf(self, *, batch_size: int = DEFAULT_BATCH_SIZE, epoch: int | None = 0,
              normalize: bool = False, as_supervised: bool = False,
              prefetch_batches: int | None = None, drop_last: bool = False,
              mean: tuple[float, float, float] | None = None,
              std: tuple[float, float, float] | None = None):
        """A tf.data.Dataset of the same batch dicts (see :mod:`raying.loader.tf`);
        ``normalize=True`` makes ``image`` float32 ``(x/255 - mean)/std`` (ImageNet's by
        default, as ``iter_torch_batches``)."""
        from raying.loader.tf import to_tf

        return to_tf(self, batch_size=batch_size,
                     epoch=None if epoch is None else _epoch(epoch), normalize=normalize,
                     as_supervised=as_supervised, prefetch_batches=prefetch_batches,
                     drop_last=drop_last, mean=mean, std=std)

    def dataset(self, epoch: int = 0):
        """A ``ray.data.Dataset`` of this epoch (read + decode + augment fused in its reads).

        Use it where Ray Data is the interface. Under Ray Train prefer
        :func:`raying.train.datasets` with :func:`raying.train.loader` in the workers
        (docs/guide-ray-train.md): every id reaches one worker once per epoch. Passed as
        ``TorchTrainer(datasets={"train": ds})`` and read with
        ``ray.train.get_dataset_shard("train")``, this dataset goes through Ray Train's default
        split, ``streaming_split(n, equal=True)``, which drops up to ``n - 1`` rows of every
        epoch whose rows do not divide by the ``n`` workers; ``ds.streaming_split(n,
        equal=False)`` keeps them all.

        Its rows are the epoch's (the same ids and pixels as the iterators'); their order is
        the plan's only where Ray Data keeps order (``DataContext.get_current()
        .execution_options.preserve_order = True``): by default it hands on blocks as their
        read tasks finish, which differs from run to run.
        """
        self._same_ray()  # before _start_ray, which would start a Ray of its own
        self._start_ray()
        self._bind()
        plan = self.plan(_epoch(epoch))
        with self._dataset_lock:
            if self._dataset_reads is None:
                # Only a lazy sampler's store takes set-asides (as priority 0); another
                # sampler's store holds what its plans read (InfoBatch's losses), and a 0
                # would be a loss.
                self._dataset_reads = DatasetReads(
                    self._ready_spec(), ManifestLookup(self.manifest),
                    self.sampler.handle if self.sampler.lazy else None)
        # The read tasks reserve what the iterator path's do: task_num_cpus, unless
        # ray_remote_args says otherwise.
        remote_args = {"num_cpus": self.config.task_num_cpus,
                       **(self.config.ray_remote_args or {})}
        return self._dataset_reads.dataset(plan, sampler=self.sampler,
                                           block_rows=self.block_rows(),
                                           fmt=self.manifest.format, size=self.transform.size,
                                           ray_remote_args=remote_args,
                                           samples=len(self.manifest),
                                           root=self.manifest.root)

    # -- feedback, stats, state ----------------------------------------------------------------
    @property
    def store_name(self) -> str | None:
        """Name of the priority store (for ``raying.report(..., store=...)`` in Train workers)."""
        self._same_ray()
        self._bind()
        return self.sampler.store_name

    def report(self, ids: Any, losses: Any) -> None:
        """Per-sample losses for ``ids`` (torch, tf or numpy); never blocks the step."""
        self._same_ray()
        self._bind()
        self.sampler.report(ids, losses)

    def priorities(self) -> np.ndarray | None:
        """Every id's current priority (prioritized sampling), or None (uniform)."""
        self._same_ray()
        self._bind()  # a prioritized pipeline not started yet starts its store here
        handle = self.sampler.handle
        if handle is None:
            return None
        from raying.sampling import store

        self.sampler.flush()
        return store.priorities(handle)

    def stats(self, *, sampling: bool = True) -> dict[str, Any]:
        """Throughput, stall share, skipped samples and (``sampling=True``) sampling health.

        ``throughput_rows_per_s`` is the rows handed to the loop over the time from the
        first batch's hand-over to the last's: start-up and the first batch's wait are left
        out, so it is above a loop's rows over its whole wall time on a cold start.
        ``stall_share`` is the share of the iteration loops' wall time the consumer spent
        waiting for a batch. ``sampling=False`` skips the round trip to the priority store.
        ``memory`` counts what this process and its read workers hold: two pipelines of one
        process share those, and each counts them (count them once).
        """
        ended = self._session_ended()
        if (ended and sampling and self.sampler.uses_store
                and getattr(self.sampler, "handle", None) is not None):
            # A store still held (not closed): asking it would start a Ray of its own. A
            # closed pipeline's sampler answers with what its store said last.
            raise self._ended_error("; stats(sampling=False) gives this process's figures")
        out = self.account.summary()
        if ended and self._dataset_reads is not None:
            self._dataset_reads.forget()  # its account actor went with the session
        # epochs read through dataset(), e.g. by Ray Train
        reads = self._dataset_reads.account() if self._dataset_reads is not None else None
        if reads is not None:
            merge_dataset_account(out, reads)
        if sampling:
            own = self.sampler.stats()
            health = self.account.health()
            per_epoch = {int(e["epoch"]): dict(e) for e in own.get("per_epoch", [])}
            for e in health.pop("per_epoch"):
                per_epoch.setdefault(int(e["epoch"]), {}).update(e)
            out["sampling"] = {**own, **health,
                               "per_epoch": [per_epoch[k] for k in sorted(per_epoch)]}
        out["memory"] = self._memory(out)
        return out

    def _memory(self, out: dict[str, Any]) -> dict[str, Any]:
        """Memory counted whole (see :mod:`raying.read.memory`): this process, the read
        workers (largest own memory each showed at the end of a unit, every node), and the
        growth of this node's tmpfs since the pipeline was built (object-store blocks and the
        decoded cache's files, mapped or not)."""
        workers = dict(out["read_workers"]["by_worker"])
        workers.update(out.get("dataset", {}).get("read_workers", {}).get("by_worker", {}))
        driver = own_kib() / 1024.0
        tmpfs = self._footprint.sample([])["tmpfs_mb"]
        cache = 0.0
        if self._spec_ready and self._spec.decoded_cache_bytes:
            from raying.read import decoded_dirs

            cache = dir_bytes(decoded_dirs.cache_dir(self._cache_name)) / (1024.0 * 1024.0)
        frameworks: dict[str, list[str]] = {}
        for part in (out["read_workers"], out.get("dataset", {}).get("read_workers", {})):
            for worker, names in part.get("frameworks", {}).items():
                frameworks[worker] = sorted(set(frameworks.get(worker, [])) | set(names))
        pss = sorted(workers.values())
        return {
            "driver_mb": round(driver, 1),
            "read_workers": len(pss),
            "read_worker_mb_max": pss[-1] if pss else None,
            "read_worker_mb_median": round(statistics.median(pss), 1) if pss else None,
            "read_workers_mb": round(sum(pss), 1),
            # worker -> the heavy frameworks (torch, tensorflow, pandas, ...) it had imported:
            # raying's read path imports none, so any here came with a user stage
            "read_worker_frameworks": frameworks,
            "tmpfs_growth_mb": round(tmpfs, 1),
            "decoded_cache_mb": round(cache, 1),
            "whole_mb": round(driver + sum(pss) + tmpfs, 1),
            "includes": ("this process and the read workers (PSS of anonymous and file pages), "
                         "plus this node's tmpfs growth since the pipeline was built (object "
                         "store, decoded cache); not Ray's own daemons, nor other nodes' "
                         "tmpfs"),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this pipeline stands: epoch, position in its plan, sampler state.

        Once an iteration has delivered its epoch to the end, the position is the start of
        the next epoch: resume with ``epoch=state["epoch"]``, whether the state was taken
        mid-epoch or after it. Through ``to_tf`` the position counts the batches handed to
        tf.data, which prefetches ahead of the model. Save it with ``pickle`` or
        ``torch.save``: a prioritized or InfoBatch sampler's state holds numpy arrays (every
        priority or score), which JSON does not take; a uniform or weighted one's is plain
        numbers and lists.
        """
        if self._closed and self.sampler.uses_store:
            msg = (f"state_dict() of Pipeline {self.name!r} after close(): its priority store "
                   f"is gone with the priorities; take state_dict() before close()")
            raise ConfigError(msg)
        if self.sampler.uses_store:  # the sampler's state lies in the store
            self._same_ray()
        cur = self._cursor
        if self._resume is not None:
            epoch, unit, row, delivered = self._resume
        elif cur.get("complete") or _delivered_to_end(cur):  # the next epoch, from its start
            epoch, unit, row, delivered = cur["epoch"] + 1, 0, 0, 0
        else:
            epoch, delivered = cur["epoch"], cur["delivered"]
            unit, row = _position(cur["units"], delivered - cur["base"],
                                  cur.get("start", (0, 0)))
        return {"version": STATE_VERSION, "epoch": epoch, "unit": unit, "row": row,
                "block_rows": self.block_rows(),
                "delivered": delivered, "sampler": self.sampler.state_dict(),
                "fingerprint": self.manifest.fingerprint(), "augment": self._augment()}

    def _augment(self) -> dict[str, Any]:
        """What makes the pixels besides the plan: the transform and the user's stages."""
        return {"transform": repr(self.transform),
                "stages": [f"{s.name}{' (with_rng)' if s.with_rng else ''}"
                           + (f" {_short_repr(dict(s.fn_kwargs))}" if s.fn_kwargs else "")
                           for s in self._stages]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration of that epoch continues there."""
        if state.get("fingerprint") != self.manifest.fingerprint():
            msg = ("state_dict was saved for a different dataset (manifest fingerprint "
                   f"{state.get('fingerprint')} != {self.manifest.fingerprint()}); rebuild the "
                   f"pipeline on the same manifest")
            raise ConfigError(msg)
        if state.get("block_rows", self.block_rows()) != self.block_rows():
            msg = (f"state_dict was saved with block_rows={state.get('block_rows')} but this "
                   f"pipeline cuts epochs into blocks of {self.block_rows()}; build it with "
                   f"PipelineConfig(block_rows={state.get('block_rows')})")
            raise ConfigError(msg)
        self._same_ray()
        self._bind()
        saved = state["sampler"]
        if self.manifest.format != "parquet" and isinstance(saved, Mapping):
            # The Parquet window shapes no plan of an image folder: not a setting to match.
            saved = {k: v for k, v in saved.items() if k != "window_row_groups"}
        self.sampler.load_state_dict(saved)
        epoch, unit, row = int(state["epoch"]), int(state["unit"]), int(state["row"])
        if (int(state.get("version", 1)) < 2 and (unit or row) and self.manifest.format ==
                "parquet" and self.sampler.name in ("uniform", "infobatch")):
            # Its position is a unit and row of a plan that cut Parquet epochs otherwise
            # (whole windows): in today's plan it would repeat or skip rows.
            logger.warning("pipeline %s: state_dict saved by an older raying, whose Parquet "
                           "plans cut an epoch into other units: epoch %d restarts from its "
                           "first row (rows read before the save are read again)", self.name,
                           epoch)
            unit, row = 0, 0
            state = {**state, "delivered": 0}  # the epoch's rows are all delivered again
        saved_augment = state.get("augment")
        if saved_augment is not None and saved_augment != self._augment():
            # Not refused: a recipe may change its augmentation on purpose between phases
            # (progressive resizing); a resume that meant to continue the same run is told.
            logger.warning("pipeline %s: the state was saved by a pipeline of other "
                           "augmentation (%s, stages %s); this one has %s, stages %s: the "
                           "resumed reads give other pixels than the saved run would have. "
                           "Build the pipeline as the saved run did if it is to continue "
                           "the same run", self.name, saved_augment.get("transform"),
                           saved_augment.get("stages"), self._augment()["transform"],
                           self._augment()["stages"])
        self._resume = (epoch, unit, row, int(state.get("delivered", 0)))
        # An iteration still running stops (SupersededError): its next rows would count in
        # the loaded position, and its reads are of the plan it had.
        self._begin_iteration()
        if self._stream is not None:
            self._stream.cancel(supersede=True)

    def close(self, *, release_store: bool = True) -> None:
        """Cancel reads in flight, flush pending feedback and, with ``release_store``, stop the
        priority store this pipeline created (after a final snapshot, if it takes them)."""
        if self._ray is not None and ray_session() != self._ray:
            self._close_after_ray()
            return
        # Iterations a consumer still holds: their threads stop at their next item, and the
        # consumer's next() raises the closed error.
        live = list(self._live_prefetch)
        for stop, _ in live:
            stop.set()
        stream, running = self._stream, []
        if stream is not None:
            running = stream.close()
            self._stream = None
        deadline = time.monotonic() + DEFAULT_CLOSE_WAIT_S
        threads = self._left_running + [thread for _, thread in live]
        for thread in threads:  # they stop at their read's end (superseded)
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            logger.warning("pipeline %s: an iterator's read still ran %.0f s after close(); "
                           "shutting Ray down now may abort the process", self.name,
                           DEFAULT_CLOSE_WAIT_S)
        self._left_running.clear()
        if self._dataset_reads is not None:
            self._dataset_reads.release()  # the dataset() reads' account actor; account kept
        self.sampler.close(release_store=release_store)
        if self._spec.decoded_cache_bytes:
            from raying.read import decoded_dirs

            # Read tasks still running (the next epoch's first units) would write cache
            # entries after the release and leave the directory behind: let them finish.
            if stream is not None and not stream.wait_done(running, DEFAULT_CLOSE_WAIT_S):
                logger.warning("pipeline %s: %d read tasks still ran %.0f s after close(); "
                               "the decoded cache is released without them", self.name,
                               len(running), DEFAULT_CLOSE_WAIT_S)
            decoded_dirs.release_everywhere(self._cache_name)  # every node's copy
        self._bound = False
        self._closed = True

    def _close_after_ray(self) -> None:
        """close() once the Ray session this pipeline used has ended: its tasks, store and
        objects went with it, and any Ray call now would start a new local Ray or fail on
        the old handles. Only this node's decoded-cache files are left to remove."""
        self._stream = None
        if self._dataset_reads is not None:
            self._dataset_reads.forget()
        forget = getattr(self.sampler, "forget_store", None)
        if forget is not None:
            forget()
        if self._spec_ready and self._spec.decoded_cache_bytes:
            from raying.read import decoded_dirs

            decoded_dirs.release(self._cache_name)
        self._bound = False
        self._closed = True

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Pipeline({self.manifest!r}, sampler={type(self.sampler).__name__}, "
                f"transform={self.transform!r}, on_error={self.on_error!r})")


def _warn_no_node_fits(task_cpus: float) -> None:
    """Warn when no live node has ``task_cpus`` CPUs: each read task would wait for one (for
    ever, unless an autoscaler adds such a node), and the first batch with it."""
    import ray

    try:
        largest = max((float(n.get("Resources", {}).get("CPU", 0.0)) for n in ray.nodes()
                       if n.get("Alive")), default=0.0)
    except Exception:  # noqa: BLE001 - a Ray that cannot list its nodes: nothing to say
        return
    # No node with CPUs at all: a head of 0 CPUs whose workers an autoscaler adds on demand.
    if largest > 0 and task_cpus > largest:
        logger.warning(
            "PipelineConfig(task_num_cpus=%s): no node of this Ray has that many CPUs (the "
            "largest has %g), so the read tasks wait until an autoscaler adds one, for ever "
            "without one; use task_num_cpus <= %g", task_cpus, largest, largest)


def _short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a stage's fn_kwargs in a state)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _sizing(resources: dict[str, float]) -> tuple[int, int]:
    """What a stream's window is sized by: the cluster's CPUs and object store bytes."""
    return int(resources.get("CPU", 1)), int(resources.get("object_store_memory", 0))


def _delivered_to_end(cur: dict[str, Any]) -> bool:
    """Whether the iteration of ``cur`` (the pipeline's cursor) has received the last block of
    its epoch's last unit and delivered every row received, but for a last batch too short
    for ``drop_last`` (fewer than the cursor's ``tail`` rows): its epoch is done, although
    the iterator was never asked past its last batch (a loop of ``steps_per_epoch`` steps)."""
    units = cur["units"]
    received = sum(end - begin for _, begin, end, _ in units)
    left = received - (cur["delivered"] - cur["base"])
    if left > 0 and left >= cur.get("tail", 0):
        return False
    if cur.get("blocks_done"):
        return True
    if bool(units) and units[-1][0] == cur.get("last_unit") and units[-1][3]:
        return True
    if not cur.get("tail") or "planned" not in cur:
        return False
    # drop_last: the blocks not received yet hold at most the rows planned for them (bad
    # samples are set aside); with the rows left, fewer than a batch: no batch is to come.
    planned = cur["planned"]
    if units:
        index, _, _, whole = units[-1]
        got = sum(end - begin for i, begin, end, _ in units if i == index)
        to_come = (0 if whole else max(0, planned.get(index, 0) - got)) + sum(
            rows for i, rows in planned.items() if i > index)
    else:
        to_come = sum(planned.values())
    return left + to_come < cur["tail"]


def _position(units: list[tuple[int, int, int, bool]], delivered: int,
              start: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """(unit index, row within that unit's output) of the next undelivered row.

    ``units`` lists the blocks received so far: (unit index, first row, end row, whether it
    was the unit's last block).
    """
    left = delivered
    for index, begin, end, _ in units:
        if left < end - begin:
            return index, begin + left
        left -= end - begin
    if units:
        index, _, end, last = units[-1]
        return (index + 1, 0) if last else (index, end)
    return start


def _files_key(manifest: Manifest) -> str:
    """The dataset's identity in the read caches: its fingerprint, and for Parquet the files'
    sizes and modification times as scanned, so that a scan after a file was rewritten (the same rows, other bytes)
    never meets the footers and row groups kept from before."""
    sizes = manifest.meta.get("file_sizes") if manifest.format == "parquet" else None
    if not sizes:
        return manifest.fingerprint()
    import hashlib

    stamps = [*sizes, *(manifest.meta.get("file_mtimes") or ())]
    digest = hashlib.sha256(",".join(map(str, stamps)).encode()).hexdigest()[:8]
    return f"{manifest.fingerprint()}-{digest}"


def _epoch(epoch: Any) -> int:
    """An epoch number: a non-negative integer (numpy integers too), never a float or bool."""
    if isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, (int, np.integer)) \
            or epoch < 0:
        msg = f"epoch must be a non-negative integer, got {epoch!r}"
        raise ConfigError(msg)
    return int(epoch)
