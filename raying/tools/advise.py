"""`raying advise URI`: measure a dataset, its storage and this machine; recommend a config.

The seed document's decision table (dataset size, data format, storage medium, CPU, GPU,
latency needs) made measurable: each factor becomes a number measured here,
and each recommendation names the number it rests on::

    dataset  (one listing, one footer)   -> size, format, file-size spread
    storage  (a few dozen real reads)    -> latency, bandwidth, gain from parallel reads
    machine                              -> cores, memory, tmpfs/disk space, GPUs, decode cost
        -> pack? pre-decode? cache tier and size, read concurrency, prefetch, block size

Example:
    >>> from raying.tools.advise import advise
    >>> report = advise("s3://bucket/train", {"endpoint_url": "http://127.0.0.1:9000"})
    >>> [(a["setting"], a["value"]) for a in report["advice"]]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from raying.options import (
    DEFAULT_MEMORY_CACHE_DIR,
    DEFAULT_PACK_ROW_GROUP_ROWS,
    StorageOptions,
    epoch_block_rows,
)
from raying.storage import files as _storage
from raying.storage.tiers import fill_concurrency
from raying.tools import advise_measure as _m

# A typical file read whole within 1 ms (and, where a long read measured it, 400 MB/s or
# more), or, for files too large to read whole in 1 ms (Parquet), a first byte within 0.25 ms
# and 400 MB/s or more: local SSD or page cache; defaults do. Network storage answers its
# first byte in a millisecond or more.
FAST_READ_S = 1e-3
FAST_FIRST_BYTE_S = 0.25e-3
FAST_BANDWIDTH_BYTES_PER_S = 400e6
# Reads are latency-bound when the wait for the first byte is at least this share of a read.
LATENCY_BOUND_SHARE = 0.5
# A device that gains less than this from 16 parallel reads serves one request at a time.
SERIAL_SPEEDUP = 2.0
# Images per second one current GPU consumes (ResNet-50-class training, mixed precision).
GPU_IMAGES_PER_S = 2500
# The memory tier takes at most this share of available memory (and half the free tmpfs);
# the disk tier at most this share of the free local disk.
MEMORY_TIER_SHARE = 0.25
DISK_TIER_SHARE = 0.5
# Decode work per read task (blocks of ~100 ms keep Ray's per-task overheads small).
TASK_DECODE_MS = 100.0
# The smallest block advised for a small image set (see the block rows' rule).
MIN_SMALL_SET_BLOCK_ROWS = 8
# Side of pre-decoded pixels (`raying pack --decode-size`), so 224 crops can still move.
DECODED_SIDE = 256
BATCH = 256
# A training step's time per batch of BATCH images, against which a pre-decoded dataset's
# batch fetch is weighed (the loader's only wait when nothing is decoded).
PREDECODED_STEP_S = 0.05
# Parquet row groups of fewer rows than this are worth packing again on slow storage.
SMALL_ROW_GROUP_ROWS = 32
# Reads in flight when small files never showed the link's bandwidth (latency-bound, S3-like).
UNSATURATED_CONCURRENCY = 64


def advise(uri: str, storage: StorageOptions | Mapping[str, Any] | None = None, *,
           machine: Mapping[str, Any] | None = None, seed: int = 0,
           image_column: str | None = None, format: str = "auto") -> dict[str, Any]:
    """Measure ``uri``, its storage and this machine, and recommend settings.

    Args:
        uri: the dataset (image folder or Parquet folder): path, ``s3://``, ``hdfs://``.
        storage: storage options, as for :meth:`raying.Manifest.scan` (``slow=`` emulates a
            slower tier).
        machine: measured machine values to override (e.g. ``{"cores": 64, "gpus": 8}``) to
            ask "what if this ran there".
        seed: which files the storage probe reads.
        image_column: Parquet's image column, as for :meth:`raying.Manifest.scan` (needed
            where the files hold no ``image`` column and several binary ones).
        format: ``"images"``, ``"parquet"`` or ``"auto"``, as for
            :meth:`raying.Manifest.scan` (a folder holding both is refused under ``"auto"``).

    Returns:
        ``{"uri", "measured": {"dataset", "storage", "machine"}, "advice": [{"setting",
        "value", "reason", "measured"}], "config": {...}}``.
    """
    fs, path = _storage.resolve(uri, StorageOptions.coerce(storage))
    if format not in ("auto", "images", "parquet"):
        from raying.errors import ConfigError

        msg = f"format must be 'auto', 'images' or 'parquet', got {format!r}"
        raise ConfigError(msg)
    data = _m.measure_dataset(fs, path, uri, image_column=image_column, format=format)
    store = _m.measure_storage(fs, data, seed=seed)
    sample = _m.sample_images(fs, data) if not data.get("pre_decoded") else []
    mach = _m.measure_machine(sample, pre_decoded=bool(data.get("pre_decoded")))
    mach.update(machine or {})
    advice, config = recommend(data, store, mach, uri=uri)
    public = {k: v for k, v in data.items() if k not in ("paths", "sizes")}
    return {"uri": uri, "measured": {"dataset": public, "storage": store, "machine": mach},
            "advice": advice, "config": config}


def recommend(data: dict[str, Any], store: dict[str, Any], mach: dict[str, Any], *,
              uri: str = "") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The decision table: one line per setting, each with its reason and measurement.

    A cache it advises lives in folders of the dataset's own (named from ``uri``): a tier
    folder's pipelines must agree on its capacity, and another dataset's advice sizes its
    tier for that dataset."""
    lat, bw = store["latency_s"], store["bandwidth_bytes_per_s"]
    long_read = store["bandwidth_from"].startswith("one ")  # else a lower bound from small reads
    fast_bw = bw >= FAST_BANDWIDTH_BYTES_PER_S  # measured, or a lower bound already above
    fast = ((store["whole_file_s"] < FAST_READ_S and (not long_read or fast_bw))
            or (lat < FAST_FIRST_BYTE_S and fast_bw))
    speedup = store["parallel_speedup"]
    # A probe of fewer than 16 parallel reads (a dataset of files over 4 MiB) measured no
    # parallelism at all: it does not make the storage one that serves a request at a time.
    measured = store.get("parallel_reads", _m.PROBE_PARALLEL_THREADS) >= _m.PROBE_PARALLEL_THREADS
    serial = speedup < SERIAL_SPEEDUP and measured
    parquet = data["format"] == "parquet"
    size = data["bytes"]
    d_ms = mach.get("decode_ms_per_image")
    cores = max(1, int(mach["cores"]))
    decode_rate = math.inf if not d_ms else cores * 1000.0 / d_ms
    demand = mach["gpus"] * GPU_IMAGES_PER_S if mach["gpus"] else decode_rate
    out: list[dict[str, Any]] = []

    def line(setting: str, value: Any, reason: str, measured: str) -> None:
        out.append({"setting": setting, "value": value, "reason": reason,
                    "measured": measured})

    io_m = (f"latency {lat * 1e3:.2f} ms, bandwidth {'' if long_read else '>= '}"
            f"{bw / 1e6:.1f} MB/s, " + (f"16 parallel reads {speedup:.1f}x serial" if measured
                                        else "parallel reads not measured"))
    # 1. pack to Parquet
    p50 = data["file_bytes_p50"]
    rpg = data["rows_per_row_group"] if parquet else 0
    if parquet and rpg < SMALL_ROW_GROUP_ROWS and not fast:
        line("pack", "yes: raying pack SRC DST",
             f"row groups of ~{rpg} rows: each request, {lat * 1e3:.1f} ms to its first "
             f"byte, brings that few samples; raying pack writes row groups of "
             f"{DEFAULT_PACK_ROW_GROUP_ROWS} rows", f"{data['files']} files, "
             f"~{_mb(data['row_group_bytes'])} per row group; {io_m}")
    elif parquet:
        line("pack", "already Parquet",
             f"row groups of ~{rpg} rows amortize each request over that many samples"
             + (" (the storage answers fast: small ones cost little)"
                if rpg < SMALL_ROW_GROUP_ROWS else ""),
             f"{data['files']} files, ~{_mb(data['row_group_bytes'])} per row group")
    elif not fast and store["latency_share"] >= LATENCY_BOUND_SHARE:
        line("pack", "yes: raying pack SRC DST",
             f"each file waits {lat * 1e3:.1f} ms for its first byte, "
             f"{store['latency_share']:.0%} of reading it whole; Parquet row groups turn "
             f"{BATCH} reads into one", f"{data['files']:,} files, p50 {_kb(p50)}; {io_m}")
    else:
        why = ("storage answers fast" if fast else
               f"transfer dominates a read ({1 - store['latency_share']:.0%} of it)")
        line("pack", "no", f"{why}: packing would not save requests that matter",
             f"{data['files']:,} files, p50 {_kb(p50)}; {io_m}")
    # 2. pre-decode
    if data.get("pre_decoded"):
        line("pre_decode", "already pre-decoded", "the image column holds pixels",
             f"image column type {data.get('image_type')}")
    elif d_ms is None:
        why = ("the report's sample line says why" if mach.get("decode_failed")
               else "no image was sampled")
        line("pre_decode", "unknown", "no sampled image could be read and decoded to time "
             f"decoding ({why})", "-")
    else:
        decoded_bytes = DECODED_SIDE * DECODED_SIDE * 3
        need_bw = demand * decoded_bytes
        m = (f"decode + crop {d_ms:.2f} ms/image/core x {cores} cores = "
             f"{decode_rate:,.0f} img/s; " + (
                 f"demand {demand:,.0f} img/s ({mach['gpus']} GPU)" if mach["gpus"]
                 else "no GPU found"))
        if not mach["gpus"]:
            line("pre_decode", "no",
                 "no GPU found on this node: a trainer on these CPUs shares their time with "
                 "the decode, and pre-decoded pixels lift only a decode that cannot keep up "
                 "with GPUs; run raying advise on a GPU node to size it against them", m)
        elif demand > decode_rate and (fast or bw >= need_bw):
            line("pre_decode", f"yes: raying pack --decode-size {DECODED_SIDE}",
                 f"the CPUs decode fewer images than the GPUs consume, and storage carries "
                 f"{_mb(decoded_bytes)} of pixels per image at {need_bw / 1e6:,.0f} MB/s", m)
        elif demand > decode_rate:
            line("pre_decode", "no",
                 f"decode binds, but pixels are ~{decoded_bytes / max(data['sample_bytes'], 1):.0f}x "
                 f"the encoded bytes and storage ({bw / 1e6:.0f} MB/s) could not carry them; "
                 f"move augmentation to the GPU instead (uint8 to the device)", m)
        else:
            line("pre_decode", "no", "the CPUs decode faster than the consumer needs", m)
    # 3. cache tier and size: the dataset as the cache holds it (a header per entry: a file,
    # or a Parquet row group's image column)
    from raying.read.cache.entry import entry_bytes

    entries = (-(-size // max(1, data.get("row_group_bytes") or size)) if parquet
               else data["files"])
    held = size + entries * entry_bytes(0)
    mem_cap = int(min(held, MEMORY_TIER_SHARE * mach["memory_available_bytes"],
                      0.5 * mach["shm_free_bytes"]))
    disk_cap = int(min(held, DISK_TIER_SHARE * mach["disk_free_bytes"])) if held > mem_cap else 0
    cache: dict[str, Any] | None = None
    if fast:
        line("cache", "none", "storage is local and fast: the OS page cache serves repeats",
             io_m)
    else:
        own = _dataset_folder(uri)
        cache = {"memory_bytes": mem_cap, "disk_bytes": disk_cap,
                 "memory_dir": f"{DEFAULT_MEMORY_CACHE_DIR}/{own}",
                 "disk_dir": (mach["disk_dir"].rstrip("/") + f"/raying-cache/{own}")
                 if disk_cap else None, "policy": "priority"}
        fits = (f"the whole dataset ({_mb(size)}) fits the memory tier" if mem_cap >= held
                else f"the dataset ({_mb(size)}) exceeds the memory tier, so a disk tier "
                     f"holds {disk_cap / held:.0%} of it")
        line("cache", f"memory {_mb(mem_cap)}" + (f" + disk {_mb(disk_cap)}" if disk_cap
                                                     else "") + ", policy priority",
             f"every read from this storage costs {lat * 1e3:.1f} ms + transfer; {fits}; the "
             f"priority policy keeps what PrioritizedSampler draws most, and under uniform "
             f"sampling a fixed subset (hits = capacity share, where LRU over a permutation "
             f"hits almost never); in folders of this dataset's own, sized for it alone (a "
             f"tier folder's pipelines must agree on its capacity)",
             f"{io_m}; {_mb(mach['memory_available_bytes'])} memory available, "
             f"{_mb(mach['disk_free_bytes'])} disk free")
    # 4. read concurrency
    req = data["row_group_bytes"] if parquet else p50
    if fast:
        conc, why = 1, "local page-cache reads are fastest one after the other"
    elif serial:
        conc, why = 2, (f"16 parallel reads were only {speedup:.1f}x faster "
                        f"than serial: the storage served one request at a time here (a disk "
                        f"head, or a throttled endpoint); 2 in flight keep it busy without "
                        f"extra seeks")
    elif long_read:
        conc = fill_concurrency(lat, bw, req)
        why = (f"latency x bandwidth = {_kb(lat * bw)} must be in flight to fill the link; "
               f"requests of {_kb(req)}, with 2x headroom")
    else:
        conc = UNSATURATED_CONCURRENCY
        why = ((f"16 parallel reads scaled {speedup:.1f}x and never reached the link's "
                f"bandwidth (files of {_kb(req)})" if measured else
                "parallel reads were not measured (no file under 4 MiB)")
               + ": many more requests can be in flight, as on S3")
    line("read_concurrency", conc, why, io_m)
    # 5. prefetch depth (batches of 256)
    per_read = lat + req / bw
    fetch_s = (BATCH * per_read / conc if not parquet
               else lat + BATCH * data["sample_bytes"] / bw)
    decode_s = BATCH * (d_ms or 0.0) / 1000.0 / cores
    trivial = max(fetch_s, decode_s) < 1e-3  # pre-decoded pixels on fast storage
    # Pre-decoded pixels (no decode measured): a batch's fetch against a training step's
    # time (it is the loader's only wait), not against a decode of ~0 (an infinite ratio
    # asked for 16 batches, ~600 MB at 224 px, on a disk that serves one in 2 ms).
    ratio = (0.0 if trivial else fetch_s / decode_s if decode_s > 0
             else fetch_s / PREDECODED_STEP_S)
    depth = int(min(16, max(2, math.ceil(min(ratio, 14.0)) + 2)))
    line("prefetch_batches", depth,
         ("a batch arrives and decodes in under a millisecond; a few batches absorb jitter"
          if trivial else
          f"the pixels are stored decoded and a batch arrives in {fetch_s * 1e3:.0f} ms, "
          f"well within a training step; a few batches absorb jitter"
          if decode_s <= 0 and ratio <= 1 else
          "fetching a batch takes longer than decoding it: the loader is I/O-bound, so "
          "prefetch deeper and let the cache and planner cut the fetches" if ratio > 1 else
          "a batch decodes slower than it arrives; a few batches absorb jitter"),
         f"fetch {fetch_s * 1e3:.0f} ms vs decode "
         + (f"{decode_s * 1e3:.0f} ms per {BATCH} images" if d_ms is not None
            else f"not measured (taken as 0) per {BATCH} images"))
    # 6. block size
    if d_ms:
        rows = 2 ** round(math.log2(max(1.0, TASK_DECODE_MS / d_ms)))
        rows = int(min(256, max(64, rows)))
    else:
        rows = 256
    if parquet:
        rows = max(rows, data["rows_per_row_group"])
    window = 2 * cores if fast or not serial else cores
    why_rows = (f"~{TASK_DECODE_MS:.0f} ms of decode per read task keeps Ray's per-task cost "
                f"small" + ("; at least one row group" if parquet else ""))
    samples = int(data.get("samples") or 0)
    if not parquet and samples and rows * window > samples:
        # A small dataset: blocks that size would leave read tasks of the window, and cores,
        # without rows; as large as still gives every one of them a block (at least 8 rows:
        # below that, Ray's cost per task outweighs the decode).
        rows = max(MIN_SMALL_SET_BLOCK_ROWS, 2 ** int(math.log2(max(1, samples // window))))
        why_rows = (f"{samples:,} samples over the window's {window} read tasks: larger "
                    f"blocks would leave cores idle")
    if samples and epoch_block_rows(samples, rows) != rows:
        # What a pipeline reads with it: an epoch of under 8 such blocks is cut into ~8.
        rows = epoch_block_rows(samples, rows)
        why_rows = (f"{samples:,} samples: a pipeline cuts an epoch of fewer than 8 blocks "
                    f"into ~8 read tasks, so a larger block_rows reads the same")
    line("block_rows", rows, why_rows,
         f"decode {d_ms:.2f} ms/image" if d_ms else "decode not measured")
    # 7. read tasks in flight
    line("window", window,
         ("two read tasks per core keep every core decoding" if window == 2 * cores else
          "one read task per core: more would only queue on the device"),
         f"{cores} cores")
    config = {"block_rows": rows, "window": window, "prefetch_batches": depth,
              "io": {"concurrency": conc, "cache": cache}}
    return out, config


def _mb(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}"


def _kb(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB" if n >= 1024**2 else f"{n / 1024:.1f} KiB"


def format_report(report: dict[str, Any]) -> str:
    """The report as text: what was measured, then one line per recommendation."""
    d, s, m = (report["measured"][k] for k in ("dataset", "storage", "machine"))
    lines = [f"raying advise {report['uri']}", "measured:",
             f"  dataset  {d['format']}: {d['files']:,} files, {d['samples']:,} samples, "
             f"{_mb(d['bytes'])}; file size p10/p50/p90 {_kb(d['file_bytes_p10'])} / "
             f"{_kb(d['file_bytes_p50'])} / {_kb(d['file_bytes_p90'])}",
             f"  storage  {s['kind']}: first byte {s['latency_s'] * 1e3:.2f} ms, bandwidth "
             f"{s['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s ({s['bandwidth_from']}), "
             + (f"16 parallel reads {s['parallel_speedup']:.1f}x serial"
                if s.get("parallel_reads", _m.PROBE_PARALLEL_THREADS) >= _m.PROBE_PARALLEL_THREADS else
                "parallel reads not measured (no file under 4 MiB)")
             + f" ({s['probe_reads']} reads)",
             f"  machine  {m['cores']} cores, {_mb(m['memory_bytes'])} memory "
             f"({_mb(m['memory_available_bytes'])} available), GPU: "
             f"{(str(m['gpus']) + 'x ' + str(m['gpu_name'])) if m['gpus'] else 'none'}, "
             f"decode {_ms(m['decode_ms_per_image'])} ms/image/core"]
    if d.get("labels"):
        lines.append(f"  labels   {d['labels']}")
    if s.get("probe_unreadable"):
        shown = s["probe_unreadable"]
        lines.append(f"  storage  {len(shown)} of the files the storage probe read could not "
                     f"be read (left out of its figures): " + "; ".join(shown[:3])
                     + ("; ..." if len(shown) > 3 else ""))
    if m.get("decode_failed"):
        over = ("the decode time is over the rest" if m["decode_ms_per_image"] is not None
                else "the decode time is unknown")
        lines.append(f"  sample   {m['decode_failed']} of {m['decode_sampled']} sampled images "
                     f"could not be read or decoded ({over}): "
                     + "; ".join(m.get("decode_failures", [])))
    lines.append("recommended:")
    for a in report["advice"]:
        lines.append(f"  {a['setting']:<17} {a['value']}")
        lines.append(f"  {'':<17}   because {a['reason']}")
        lines.append(f"  {'':<17}   measured: {a['measured']}")
    c = report["config"]
    cache = c["io"]["cache"]
    io = (f"IOConfig(concurrency={c['io']['concurrency']}"
          + (f", cache=CacheConfig(memory_bytes={cache['memory_bytes']}, memory_dir="
             f"{cache['memory_dir']!r}, disk_bytes={cache['disk_bytes']}, disk_dir="
             f"{cache['disk_dir']!r}, policy='priority')"
             if cache else "") + ")")
    lines.append(f"as code:\n  PipelineConfig(block_rows={c['block_rows']}, window={c['window']}, "
                 f"io={io})  # iter_*_batches(prefetch_batches={c['prefetch_batches']})")
    return "\n".join(lines)


def _dataset_folder(uri: str) -> str:
    """A folder name of the dataset's own: its last path part (readable) and a hash of the
    whole URI (two datasets named alike stay apart)."""
    import hashlib
    import os
    import re

    if "://" not in uri or uri.lower().startswith("file:"):  # one folder, however spelt
        from raying.storage.spec import _local_path

        uri = os.path.realpath(_local_path(uri))
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", uri.rstrip("/").rsplit("/", 1)[-1]).strip("-.")
    digest = hashlib.sha256(uri.encode()).hexdigest()[:10]
    return f"{tail[:40] or 'dataset'}-{digest}"


def main(ns: Any) -> int:
    """The `raying advise` command (see raying/tools/cli.py): prints the report, or JSON."""
    opts = {k: getattr(ns, k) for k in ("endpoint_url", "region", "profile", "slow")
            if getattr(ns, k, None)}
    if getattr(ns, "anonymous", False):
        opts["anonymous"] = True
    report = advise(ns.uri, opts or None, image_column=getattr(ns, "image_column", None),
                    format=getattr(ns, "format", None) or "auto")
    if getattr(ns, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0
