"""Measurements behind `raying advise`: the dataset, a sample of storage reads, this machine."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raying.dataset.manifest import IMAGE_EXTENSIONS, PARQUET_EXTENSIONS
from raying.errors import StorageError
from raying.options import DEFAULT_MEMORY_CACHE_DIR
from raying.storage import files as _storage
from raying.storage.slow import SlowFileSystemHandler

# Storage probe: serial reads (latency), parallel reads (concurrency), one long read (bandwidth).
PROBE_SERIAL_READS = 8
PROBE_PARALLEL_READS = 32
PROBE_PARALLEL_THREADS = 16
PROBE_LONG_READ_BYTES = 8 * 1024**2
PROBE_DECODE_IMAGES = 8
PROBE_FOOTERS = 32
# Images the report names when some of the decode sample could not be read or decoded.
SHOWN_FAILURES = 3


@dataclasses.dataclass
class ImageSample:
    """Encoded images for the decode timing, where each came from, and what could not be read
    ("name: reason")."""

    images: list[Any]
    names: list[str]
    unreadable: list[str] = dataclasses.field(default_factory=list)


def _nothing_to_measure(uri: str, path: str, infos: list[Any], format: str) -> Exception:
    """The error for a listing without the files ``format`` reads, worded as
    ``raying scan``'s: what was asked for, what is there, and the flag that reads it."""
    from raying.errors import DataError

    parquet = ", ".join(f"*{e}" for e in PARQUET_EXTENSIONS)
    images = ", ".join(IMAGE_EXTENSIONS)
    named = len(infos) == 1 and infos[0].path.rstrip("/") == path.rstrip("/")
    if named and not infos[0].path.lower().endswith(PARQUET_EXTENSIONS + IMAGE_EXTENSIONS):
        return DataError(f"{uri} names one file, which is neither Parquet ({parquet}) nor an "
                         f"image ({images}); point at the dataset's folder or at a data file "
                         f"(--format parquet reads Parquet under another name)")
    seen = sorted({os.path.splitext(i.path)[1].lower() or "(none)" for i in infos})[:8]
    there = f"; found endings {', '.join(seen)}" if seen else " (it is empty)"
    if format == "parquet":
        return DataError(f"no Parquet files ({parquet}) found under {uri}{there}; check the "
                         f"URI, or use --format images for an image folder")
    if format == "images":
        return DataError(f"no images ({images}) found under {uri}{there}; check the URI, or "
                         f"use --format parquet for Parquet files")
    return DataError(f"no images ({images}) or Parquet files ({parquet}) under {uri}{there}; "
                     f"check the URI")


def measure_dataset(fs: pafs.FileSystem, path: str, uri: str, *,
                    image_column: str | None = None, format: str = "auto") -> dict[str, Any]:
    """Format, sample count, bytes and file-size spread from one listing (and one footer).
    The image column of Parquet is found as :meth:`raying.Manifest.scan` finds it (a
    ``DataError`` where it cannot tell: pass ``image_column``)."""
    from raying.dataset.scan import parquet_members

    # Listed as Manifest.scan lists: "_" names are kept for images (a class "_other"),
    # dropped for Parquet (Spark's _SUCCESS, _temporary); loops of links refused first.
    if isinstance(fs, pafs.LocalFileSystem):
        _storage.check_links(path, uri)
    infos = _storage.list_files(fs, path, skip_prefixes=".")
    parquet = parquet_members(path, infos, PARQUET_EXTENSIONS)
    if (format == "parquet" and len(infos) == 1
            and infos[0].path.rstrip("/") == path.rstrip("/")):
        parquet = infos  # one file named, said to be Parquet (as Manifest.scan takes it)
    images = [i for i in infos if i.path.lower().endswith(IMAGE_EXTENSIONS)]
    if format == "auto" and parquet and images:  # as Manifest.scan refuses it
        from raying.errors import ConfigError

        msg = (f"{uri} holds both Parquet files ({len(parquet)}) and image files "
               f"({len(images)}); say which it is: format='images' or format='parquet' "
               f"(raying advise --format images|parquet)")
        raise ConfigError(msg)
    if format == "images":
        parquet = []
    elif format == "parquet":
        images = []
    chosen = parquet or images
    if not chosen:
        raise _nothing_to_measure(uri, path, infos, format)
    sizes = np.array([i.size for i in chosen], dtype=np.int64)
    out: dict[str, Any] = {
        "format": "parquet" if parquet else "images", "files": len(chosen),
        "bytes": int(sizes.sum()),
        "file_bytes_p10": int(np.percentile(sizes, 10)),
        "file_bytes_p50": int(np.percentile(sizes, 50)),
        "file_bytes_p90": int(np.percentile(sizes, 90)),
        "paths": [i.path for i in chosen], "sizes": sizes.tolist(),
    }
    if parquet:
        # Footers of up to PROBE_FOOTERS files: exact counts for small sets, else rows per
        # byte of those files times the bytes of all (files of a set can differ in rows).
        known = parquet[:PROBE_FOOTERS]

        def footer(info: pafs.FileInfo) -> pq.FileMetaData:
            from raying.dataset.scan import _read_footer

            rel = info.path[len(path.rstrip("/")) + 1:] if info.path != path else ""
            return _read_footer(fs, info.path, f"{uri.rstrip('/')}/{rel}" if rel else uri)

        with ThreadPoolExecutor(min(8, len(known))) as pool:
            metas = list(pool.map(footer, known))
        # The first file with rows speaks for the set (an empty part's schema may say
        # nothing: pandas writes an empty object column as type null); files of no rows
        # hold no sample, and the scan leaves them out.
        first = next((k for k, m in enumerate(metas) if m.num_rows > 0), None)
        if first is None and len(known) == len(parquet):
            from raying.errors import DataError

            msg = f"{uri} holds Parquet files but no rows; the dataset is empty"
            raise DataError(msg)
        first = first or 0
        if len(known) == len(parquet):
            out["files"] = sum(1 for m in metas if m.num_rows > 0)
        md = metas[first]
        from raying.dataset.scan import pick_image_column

        rel = (known[first].path[len(path.rstrip("/")) + 1:] if known[first].path != path
               else "")
        col = pick_image_column(md.schema.to_arrow_schema(), image_column,
                                 f"{uri.rstrip('/')}/{rel}" if rel else uri)
        typ = str(md.schema.to_arrow_schema().field(col).type)
        rows = sum(m.num_rows for m in metas)
        known_bytes = sum(int(i.size) for i in known)
        estimated = len(known) < len(parquet)
        samples = (round(rows * out["bytes"] / max(known_bytes, 1)) if estimated else rows)
        out.update(
            samples=int(samples), samples_estimated=estimated,
            row_groups_per_file=md.num_row_groups,
            rows_per_row_group=int(md.num_rows / max(md.num_row_groups, 1)),
            row_group_bytes=int(known[first].size / max(md.num_row_groups, 1)),
            sample_file=known[first].path, image_column=col, image_type=typ,
            pre_decoded=typ.startswith("fixed_size_binary"))
        out["sample_bytes"] = int(out["bytes"] / max(out["samples"], 1))
        schema = md.schema.to_arrow_schema()
        if "label" in schema.names:
            out["labels"] = f"column 'label' ({schema.field('label').type})"
        elif any("/label=" in i.path[len(path.rstrip("/")):] for i in parquet):
            out["labels"] = "hive partition folders label=<value>/"
        else:
            out["labels"] = (f"none found: the files have no 'label' column (columns: "
                             f"{', '.join(schema.names)}) and no label=<value>/ folders, and "
                             f"Manifest.scan refuses them as given: pass it label='<column>', "
                             f"or label=None for unlabelled data (raying scan and pack: "
                             f"--label COLUMN, --label none)")
            out["labels_refused"] = True
    else:
        exts: dict[str, int] = {}
        for i in images:
            e = os.path.splitext(i.path)[1].lower().lstrip(".")
            exts[e] = exts.get(e, 0) + 1
        out.update(samples=len(images), extensions=exts, pre_decoded=False,
                   sample_bytes=int(np.median(sizes)))
        root = path.rstrip("/") + "/"
        rel = [i.path[len(root):] if i.path.startswith(root) else "" for i in images]
        top = sum(1 for r in rel if "/" not in r)
        classes = {r.split("/", 1)[0] for r in rel if "/" in r}
        if top:
            out["labels"] = (f"{top:,} of {len(images):,} images lie at the top level, in no "
                             f"class folder: Manifest.scan (label='folder') refuses them; "
                             f"move them into class folders, or scan with label=None for "
                             f"unlabelled data")
            out["labels_refused"] = True
        else:
            out["labels"] = f"{len(classes):,} class folders"
    return out


def measure_storage(fs: pafs.FileSystem, data: dict[str, Any], *, seed: int = 0
                    ) -> dict[str, Any]:
    """Latency, bandwidth and the benefit of parallel reads, from a sample of real reads.

    * latency: median time to the first byte (open + 1-byte read) over a few files;
    * whole-file time: median time to read a small file whole, serially;
    * parallel: files/s of ``PROBE_PARALLEL_READS`` whole reads on 16 threads, against the
      serial rate (a disk head gains little; S3 gains almost 16x);
    * bandwidth: one long read (up to 8 MiB) of the largest file, less one latency; for
      datasets of small files the parallel batch's bytes/s or the serial reads', whichever
      is higher (a lower bound).
    """
    rng = np.random.default_rng(seed)
    paths, sizes = data["paths"], np.asarray(data["sizes"])
    order = rng.permutation(len(paths))
    # Files a probe read could not read (no permission, removed since the listing, an object
    # refused): named in the report, left out of the figures.
    unreadable: dict[int, str] = {}

    def timed(i: int, nbytes: int) -> float | None:
        t0 = time.perf_counter()
        try:
            with fs.open_input_file(paths[i]) as f:
                f.read_at(nbytes, 0)
        except Exception as exc:  # noqa: BLE001 - any storage error: the file is named
            unreadable[i] = f"{paths[i]}: {_first_line(exc)}"
            return None
        return time.perf_counter() - t0

    pick = [int(i) for i in order[:PROBE_SERIAL_READS]]
    first = [t for t in (timed(i, 1) for i in pick) if t is not None]
    if not first:
        from raying.errors import StorageError

        msg = (f"none of the {len(pick)} files the storage probe read could be read, e.g. "
               f"{next(iter(unreadable.values()))}; check the folder's permissions and the "
               f"storage")
        raise StorageError(msg)
    pick = [i for i in pick if i not in unreadable]
    small = [i for i in pick if sizes[i] <= 4 * 1024**2] or pick[:2]
    whole = [t for t in (timed(i, int(sizes[i])) for i in small) if t is not None]
    small = [i for i in small if i not in unreadable]
    if not whole:
        whole, small = first, pick
    latency = statistics.median(first)
    whole_s = statistics.median(whole)
    par = [int(i) for i in order[:PROBE_PARALLEL_READS]
           if sizes[int(i)] <= 4 * 1024**2 and int(i) not in unreadable]
    if par and len(par) < PROBE_PARALLEL_THREADS:
        # Few small files: read them again, so that 16 reads are in flight (one read on 16
        # threads would measure no gain, as of a device serving one request at a time).
        par = [par[k % len(par)] for k in range(PROBE_PARALLEL_THREADS)]
    par = par or small
    with ThreadPoolExecutor(PROBE_PARALLEL_THREADS) as pool:
        # Start the threads first: their creation is not storage time (on a fast local disk
        # it would dominate, and the reads would look slower in parallel than serially).
        list(pool.map(time.sleep, [0.01] * PROBE_PARALLEL_THREADS))
        t0 = time.perf_counter()
        got = list(pool.map(lambda i: _read_whole(fs, paths[i], int(sizes[i]), unreadable, i),
                            par))
        par_s = time.perf_counter() - t0
    par_rate = len(par) / par_s
    serial_rate = 1.0 / whole_s
    big = int(np.argmax(sizes))
    long_bytes = int(min(sizes[big], PROBE_LONG_READ_BYTES))
    bandwidth, how = sum(got) / par_s, "parallel small reads (a lower bound)"
    serial_bw = float(np.median(sizes[small])) / whole_s if whole_s > 0 else 0.0
    if serial_bw > bandwidth:  # threads can cost more than tiny reads from the page cache
        bandwidth, how = serial_bw, "serial small reads (a lower bound)"
    took = timed(big, long_bytes) if long_bytes >= 256 * 1024 else None
    if took is not None:
        # Take the first byte's latency off only when the read is well above it: a read
        # about as fast as the latency (one small file, cached) would leave noise, and a
        # near-zero time an absurd rate (740 GB/s of a 0.7 MiB Parquet file).
        dt = took - latency if took > 2 * latency else took
        if long_bytes / dt > bandwidth:
            bandwidth, how = long_bytes / dt, f"one {long_bytes / 1024**2:.1f} MiB read"
    handler = getattr(fs, "handler", None)
    kind = _kind(fs)
    return {"kind": kind,
            "simulated": isinstance(handler, SlowFileSystemHandler),
            "latency_s": latency, "whole_file_s": whole_s,
            "latency_share": min(1.0, latency / whole_s) if whole_s > 0 else 1.0,
            "bandwidth_bytes_per_s": bandwidth, "bandwidth_from": how,
            "serial_files_per_s": serial_rate, "parallel_files_per_s": par_rate,
            "parallel_speedup": par_rate / serial_rate,
            # Fewer than 16 reads in flight (every file over 4 MiB: a one-file dataset) say
            # nothing about how the storage serves parallel requests.
            "parallel_reads": len(par),
            "probe_reads": len(pick) + len(small) + len(par) + 1,
            "probe_unreadable": sorted(unreadable.values())}


def _read_whole(fs: pafs.FileSystem, path: str, size: int, unreadable: dict[int, str],
                i: int) -> int:
    """Bytes read of the whole file (0, and the file named in ``unreadable``, when it
    cannot be read)."""
    try:
        with fs.open_input_file(path) as f:
            return len(f.read_at(size, 0))
    except Exception as exc:  # noqa: BLE001 - any storage error: the file is named
        unreadable[i] = f"{path}: {_first_line(exc)}"
        return 0


def _kind(fs: pafs.FileSystem) -> str:
    handler = getattr(fs, "handler", None)
    if isinstance(handler, SlowFileSystemHandler):
        return f"{_kind(handler.base)} (simulated slow tier)"
    if isinstance(fs, pafs.LocalFileSystem):
        return "local"
    if isinstance(fs, pafs.S3FileSystem):
        return "s3"
    return type(fs).__name__.replace("FileSystem", "").lower() or "other"


def measure_machine(sample: ImageSample | list[Any] | None = None, *,
                    pre_decoded: bool = False) -> dict[str, Any]:
    """Cores, memory, tmpfs and local disk space, GPUs (torch.cuda if importable), decode cost.

    Args:
        sample: a few encoded images (an :class:`ImageSample`, or bytes) to time decode +
            random crop 224 on one core; those that could not be read or decoded are counted
            (``decode_sampled``, ``decode_failed``) and named (``decode_failures``, the first
            few), and the timing is over the rest.
        pre_decoded: the data is stored as pixels; decode costs nothing.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    mem_total, mem_avail = _memory()
    shm = DEFAULT_MEMORY_CACHE_DIR.rsplit("/", 1)[0]
    out: dict[str, Any] = {
        "cores": cores, "memory_bytes": mem_total, "memory_available_bytes": mem_avail,
        "shm_free_bytes": _free(shm), "disk_free_bytes": _free(tempfile.gettempdir()),
        "disk_dir": tempfile.gettempdir(), "gpus": 0, "gpu_name": None}
    try:
        import torch

        if torch.cuda.is_available():
            out["gpus"] = torch.cuda.device_count()
            out["gpu_name"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA install: no GPU then
        pass
    if pre_decoded:
        out["decode_ms_per_image"] = 0.0
        return out
    if not isinstance(sample, ImageSample):
        images = list(sample or [])
        sample = ImageSample(images, [f"sample {i}" for i in range(len(images))])
    ms, failures = _decode_ms(sample)
    out.update(decode_ms_per_image=ms, decode_sampled=len(sample.images) + len(sample.unreadable),
               decode_failed=len(failures), decode_failures=failures[:SHOWN_FAILURES])
    return out


def _decode_ms(sample: ImageSample) -> tuple[float | None, list[str]]:
    """Milliseconds per image of decode + random crop 224 over the sample's good images (None
    when none decoded), and "name: reason" of each image that could not be read or decoded."""
    failures = list(sample.unreadable)
    if not sample.images:
        return None, failures
    from raying.image.transform import ImageTransform

    tf = ImageTransform(size=224)
    ids = np.arange(len(sample.images), dtype=np.int64)
    res = tf.apply_encoded(sample.images, ids, seed=0, epoch=0)  # finds the bad ones, warms up
    failures += [f"{sample.names[int(e.sample_id)]}: {e.reason}"
                 + (f" ({e.detail})" if e.detail else "") for e in res.errors]
    good = [d for d, ok in zip(sample.images, res.ok, strict=True) if ok]
    if not good:
        return None, failures
    t0 = time.perf_counter()  # timed over the good images alone
    tf.apply_encoded(good, ids[:len(good)], seed=0, epoch=0)
    return 1000 * (time.perf_counter() - t0) / len(good), failures


def _memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):  # pragma: no cover - not Linux
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def _free(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def sample_images(fs: pafs.FileSystem, data: dict[str, Any], n: int = PROBE_DECODE_IMAGES
                  ) -> ImageSample:
    """A few encoded images of the dataset, for the decode timing; files that cannot be read
    are set aside in ``unreadable`` (a probe does not stop at one bad file)."""
    out = ImageSample([], [])
    if data["format"] == "images":
        for p in data["paths"][:: max(1, len(data["paths"]) // n)][:n]:
            try:
                out.images.append(_storage.read_bytes(fs, p))
                out.names.append(p)
            except (StorageError, OSError) as exc:
                out.unreadable.append(f"{p}: {_first_line(exc)}")
        return out
    if data.get("pre_decoded") or not data.get("image_column"):
        return out
    path = data.get("sample_file", data["paths"][0])
    try:
        with _storage.open_input(fs, path) as fh:
            pf = pq.ParquetFile(fh)
            col = pf.read_row_group(0, columns=[data["image_column"]]).column(0)
    except (StorageError, OSError, pa.ArrowException) as exc:
        out.unreadable.append(f"{path} (row group 0): {_first_line(exc)}")
        return out
    for row, v in enumerate(col[:n]):
        value = v.as_py()
        if isinstance(value, dict):  # {bytes, path}: Hugging Face Image
            value = value.get("bytes")
        if value is None:
            out.unreadable.append(f"{path} row {row}: null image")
            continue
        out.images.append(value)
        out.names.append(f"{path} row {row}")
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
