"""raying against a live HDFS: Hadoop's NameNode and DataNode on 127.0.0.1 (tests/hdfscluster.py).

Every read and write goes through pyarrow's HadoopFileSystem, libhdfs and a JVM, in this process
and in the Ray workers; the same data read from the local disk is the reference. The hdfs
fixture sets the client environment before this module's Ray starts, so workers inherit it.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

import raying
from raying.options import IOConfig
from raying.storage import files as storage
from raying.tools import cli
from raying.tools.datagen import make_image_folder

pytestmark = pytest.mark.hdfs
TRANSFORM = raying.ImageTransform(size=32)  # random crops and flips, keyed by (seed, epoch, id)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_local(hdfs, ray_local):
    """The integration Ray, started after (and so with) the HDFS client environment."""
    return ray_local


def upload(cluster, local_dir: Path, path: str) -> str:
    """Copy a local folder to ``path`` on the cluster (in a process of its own); its URI."""
    return cluster.put(local_dir, path)


@pytest.fixture(scope="module")
def hdfs_images(hdfs, image_folder):
    return upload(hdfs, image_folder, "/data/images")


@pytest.fixture(scope="module")
def packed_local(image_folder, tmp_path_factory, ray_local):
    dst = tmp_path_factory.mktemp("packed")
    raying.pack(str(image_folder), str(dst), shard_rows=25, row_group_rows=8, progress=False)
    return dst


def _epoch(pipe, epoch=0, batch_size=16):
    ids, labels, images = [], [], []
    for b in pipe.iter_batches(batch_size=batch_size, epoch=epoch):
        ids.append(b["id"])
        labels.append(b["label"])
        images.append(b["image"])
    return np.concatenate(ids), np.concatenate(labels), np.concatenate(images)


def _same_epochs(local, remote, transform=TRANSFORM, **config):
    """One uniform epoch of each manifest through its own Pipeline; identical arrays."""
    pipes = [raying.Pipeline(m, transform=transform,
                             config=raying.PipelineConfig(block_rows=16, decoded_cache="off",
                                                          **config)) for m in (local, remote)]
    try:
        a, b = (_epoch(p) for p in pipes)
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
        stats = pipes[1].stats(sampling=False)
        assert stats["bytes_read"] > 0 and stats["skipped_count"] == 0
        return b, stats
    finally:
        for p in pipes:
            p.close()


def _workers_with(library: Path) -> list[int]:
    """PIDs of this process's descendants (Ray's workers) that have ``library`` loaded."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
    me, out = os.getpid(), []
    for pid in parent:
        p = parent.get(pid)
        while p and p != me:
            p = parent.get(p)
        if p == me:
            with contextlib.suppress(OSError):
                if str(library) in Path(f"/proc/{pid}/maps").read_text():
                    out.append(pid)
    return out


# --- storage functions ----------------------------------------------------------------------


def test_write_list_read_roundtrip(hdfs):
    fs, base = storage.resolve(hdfs.uri("/scratch/roundtrip"))
    assert isinstance(fs, pafs.HadoopFileSystem) and base == "/scratch/roundtrip"
    storage.write_bytes_atomic(fs, f"{base}/a/x.bin", b"hello hdfs")
    storage.write_bytes_atomic(fs, f"{base}/a/x.bin", b"hello again")  # replaced whole
    [info] = storage.list_files(fs, base)  # no temp file left behind
    assert (info.path, info.size) == (f"{base}/a/x.bin", 11)
    assert storage.read_bytes(fs, info.path) == b"hello again"
    got = storage.read_many(fs, [info, f"{base}/nope"])
    assert got[0] == b"hello again"
    assert isinstance(got[1], storage.NotFoundError)
    assert str(got[1]) == f"{hdfs.url}{base}/nope does not exist; check the path"
    with pytest.raises(storage.NotFoundError, match=r"/scratch/missing does not exist"):
        storage.list_files(fs, "/scratch/missing")


_SIGSEGV_OWNER = """
import ctypes, sys
import ray
from raying.storage import files
fs, path = files.resolve(sys.argv[1])  # the JVM starts in this process, before Ray
fs.get_file_info(path)
ray.init(address="local", num_cpus=1, include_dashboard=False)
action = ctypes.create_string_buffer(256)  # struct sigaction: the handler comes first
ctypes.CDLL(None).sigaction(11, None, action)
handler = ctypes.c_void_p.from_buffer(action).value or 0
owner = "nothing mapped"
for line in open("/proc/self/maps"):  # the file mapped where the handler's code lies
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= handler < hi:
        owner = rest[-1] if len(rest) >= 5 else "anonymous memory"
print("SIGSEGV handler in", owner)
ray.shutdown()
"""


def test_ray_started_after_the_jvm_leaves_it_its_signal_handler(hdfs, tmp_path):
    """A driver that scans an hdfs:// dataset (starting libhdfs's JVM) and then starts Ray
    keeps the JVM's SIGSEGV handler: Ray's failure handler over it turns the JVM's own
    deliberate faults into crashes of the process."""
    script = tmp_path / "owner.py"
    script.write_text(_SIGSEGV_OWNER)
    env = {**os.environ, **hdfs.client_env}
    env.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    done = subprocess.run([sys.executable, str(script), hdfs.uri("/")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("SIGSEGV handler in")]
    assert Path(line.split(" in ", 1)[1]).name.startswith("libjvm"), line


_INTERRUPTED = """
import os, signal, sys, time
import raying

# Python's own handler, as an interactive run has it (a process started in the background of
# a non-interactive shell, as CI's, inherits SIGINT ignored and Python leaves it so).
signal.signal(signal.SIGINT, signal.default_int_handler)
raying.Manifest.scan(sys.argv[1], label=None)  # starts libhdfs's JVM in this process
try:
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        time.sleep(5)
    finally:
        print("finally ran", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def test_ctrl_c_after_the_jvm_started_is_python_s(hdfs, hdfs_images, tmp_path):
    """The JVM took SIGINT for itself and ended the process at Ctrl-C (exit 130): no
    KeyboardInterrupt, no finally blocks, no pipe.close() (now and then a segmentation
    fault instead). Started with -Xrs, it leaves SIGINT to Python."""
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    env = {**os.environ, **hdfs.client_env}
    done = subprocess.run([sys.executable, str(script), hdfs_images], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.split() == ["finally", "ran", "KeyboardInterrupt"], done.stdout


# --- scan, pack, pipeline: the same as local ------------------------------------------------


def test_scan_of_an_image_folder_matches_local(hdfs, hdfs_images, image_folder):
    local = raying.Manifest.scan(str(image_folder))
    remote = raying.Manifest.scan(hdfs_images)
    assert remote.root == hdfs_images and len(remote) == len(local) == 60
    assert remote.classes == local.classes
    assert np.array_equal(remote.labels, local.labels)
    assert np.array_equal(remote.sizes, local.sizes)
    assert remote.path_of(np.arange(60)) == local.path_of(np.arange(60))


def test_scan_of_parquet_matches_local(hdfs, packed_local):
    uri = upload(hdfs, packed_local, "/data/packed-upload")
    local = raying.Manifest.scan(str(packed_local), format="parquet", label="label")
    remote = raying.Manifest.scan(uri, format="parquet", label="label")
    assert remote.format == "parquet" and len(remote) == len(local) == 60
    assert np.array_equal(remote.labels, local.labels)
    assert remote.path_of(np.arange(60)) == local.path_of(np.arange(60))
    assert remote.files == local.files
    assert np.array_equal(remote.row_group_table()[3], local.row_group_table()[3])


def test_pipeline_epochs_match_local_with_two_workers_reading(hdfs, hdfs_images, image_folder,
                                                             ray_local):
    local = raying.Manifest.scan(str(image_folder))
    remote = raying.Manifest.scan(hdfs_images)
    (ids, labels, images), stats = _same_epochs(local, remote, window=4)
    assert sorted(ids.tolist()) == list(range(60))
    assert np.array_equal(labels, local.labels[ids])
    assert sum(stats["rows_by_node"].values()) == 60  # every row was read in a Ray task
    # Two Ray workers (num_cpus=2) ran the read tasks, each with libhdfs and a JVM loaded.
    readers = _workers_with(Path(hdfs.install.native) / "libhdfs.so")
    assert len(readers) >= 2, readers

    # Prioritized: which ids are drawn depends on the store's timing, not only on the seed, so
    # each delivered row is checked against the local reading of the same id, with a
    # transform without randomness (the pixels then depend on the id alone).
    plain = raying.ImageTransform(size=32, random_crop=False, flip=False)
    (ids, _, images), _ = _same_epochs(local, remote, transform=plain)
    pixels = dict(zip(ids.tolist(), images, strict=True))
    sampler = raying.PrioritizedSampler(alpha=1.0, uniform_mix=0.2, seed=5,
                                        samples_per_epoch=96)
    pipe = raying.Pipeline(remote, transform=plain, sampler=sampler,
                           config=raying.PipelineConfig(block_rows=16, decoded_cache="off"))
    try:
        pipe.report(np.arange(60), np.where(local.labels == 0, 9.0, 1.0))  # class 0 is hard
        sampler.flush()
        raying.sampling.store.flush(sampler.handle)
        drawn, labels, images = _epoch(pipe)
        assert pipe.stats(sampling=False)["skipped_count"] == 0
    finally:
        pipe.close()
    assert len(drawn) == 96 and len(np.unique(drawn)) < 96  # drawn with replacement
    assert np.mean(local.labels[drawn] == 0) > 0.5  # the hard third, drawn most
    assert np.array_equal(labels, local.labels[drawn])
    for i, image in zip(drawn.tolist(), images, strict=True):
        assert np.array_equal(image, pixels[i]), i


def test_raying_pack_writes_parquet_to_hdfs(hdfs, image_folder, packed_local, ray_local,
                                           capsys):
    dst = hdfs.uri("/data/packed")
    argv = ["pack", str(image_folder), dst, "--shard-rows", "25", "--row-group-rows", "8",
            "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 60 and summary["shards"] == 3
    fs, root = storage.resolve(dst)
    written = storage.list_files(fs, root, extensions=(".parquet",))
    assert [i.path.rsplit("/", 1)[1] for i in written] == sorted(
        p.name for p in packed_local.glob("*.parquet"))
    assert cli.main(argv) == 2  # shards already there: refused, not overwritten
    assert f"{dst} already holds 3 Parquet file(s)" in capsys.readouterr().err
    local = raying.Manifest.scan(str(packed_local), format="parquet", label="label")
    remote = raying.Manifest.scan(dst, format="parquet", label="label")
    assert len(remote) == 60 and np.array_equal(remote.labels, local.labels)
    (ids, _, _), _ = _same_epochs(local, remote)
    assert sorted(ids.tolist()) == list(range(60))


# --- an outage ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "planned"), [("images", False), ("parquet", False),
                                               ("parquet", True)])
def test_datanode_restarted_mid_epoch_loses_nothing(kind, planned, hdfs, tmp_path, monkeypatch,
                                                    ray_local):
    """The only DataNode stops while read tasks are running and comes back a few seconds
    later: reads fail (the blocks have no live replica), are retried, and the epoch completes
    with every id exactly once and the retries counted. Parquet is read whole-file by pyarrow,
    or (planned) as coalesced column-chunk ranges."""
    n = 240
    folder = make_image_folder(tmp_path / "outage", n=n, classes=4, size=(24, 24), seed=7)
    if kind == "parquet":
        raying.pack(str(folder), str(tmp_path / "packed"), shard_rows=40, row_group_rows=10,
                    progress=False)
        folder = tmp_path / "packed"
    uri = upload(hdfs, folder, f"/data/outage-{kind}")
    m = raying.Manifest.scan(uri, format=kind, label="folder" if kind == "images" else "label")
    assert len(m) == n
    # Enough attempts (backoff 0.2 s, doubling, up to 5 s) to outlast a DataNode restart.
    monkeypatch.setenv("RAYING_READ_RETRIES", "12")
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16),
                           config=raying.PipelineConfig(block_rows=10, window=2,
                                                        decoded_cache="off",
                                                        io=IOConfig() if planned else None))
    ids = []
    restart = threading.Thread(target=lambda: (time.sleep(1.0), hdfs.start_datanode()))
    try:
        for i, b in enumerate(pipe.iter_batches(batch_size=10, epoch=0, prefetch_batches=1)):
            ids.extend(b["id"].tolist())
            if i == 2:
                hdfs.stop_datanode()  # most of the 24 units still to read or in flight
                restart.start()
        restart.join()
        stats = pipe.stats(sampling=False)
    finally:
        pipe.close()
        if restart.is_alive():
            restart.join()
        hdfs.start_datanode()
    assert sorted(ids) == list(range(n)), "every id once, none lost to the outage"
    assert stats["skipped_count"] == 0 and stats["rows_delivered"] == n
    assert stats["read_retries"] > 0, stats
    print(f"DataNode restart ({kind}{', planned' if planned else ''}): {n} rows, "
          f"{stats['read_retries']} reads retried")
    assert stats["io"]["retries"] == stats["read_retries"]


def test_a_datanode_down_for_longer_than_the_retries_stops_the_epoch_not_the_files(
        hdfs, tmp_path, monkeypatch, ray_local):
    """Reads that outlast their retries because no DataNode answers, every read of a unit:
    even under on_error="skip" the epoch stops with a StorageError and no file is set aside
    (a sampler would never draw a set-aside file again); with the DataNode back, the next
    epoch reads every file. ("HDFS read failed" may be one file's lost block, so this is the
    every-read-failed rule; a NameNode that does not answer, an outage by itself, is checked
    in test_a_namenode_that_does_not_answer_is_named_not_a_missing_path.)"""
    n = 12
    folder = make_image_folder(tmp_path / "down", n=n, classes=2, size=(24, 24), seed=3)
    uri = upload(hdfs, folder, "/data/down")
    m = raying.Manifest.scan(uri)
    monkeypatch.setenv("RAYING_READ_RETRIES", "2")
    pipe = raying.Pipeline(m, transform=raying.ImageTransform(size=16), on_error="skip",
                           sampler=raying.WeightedSampler(weights=np.ones(n)),
                           config=raying.PipelineConfig(block_rows=3, window=2,
                                                        decoded_cache="off"))
    hdfs.stop_datanode()
    try:
        with pytest.raises(raying.StorageError, match=r"reads of this unit.*on_error='skip' "
                                                      r"sets bad files aside, not outages"):
            list(pipe.iter_batches(batch_size=4, epoch=0))
        stats = pipe.stats(sampling=False)
    finally:
        hdfs.start_datanode()
    assert stats["skipped_count"] == 0, stats["skipped"]
    ids = [int(i) for b in pipe.iter_batches(batch_size=4, epoch=1) for i in b["id"]]
    pipe.close()
    assert len(ids) == n  # the storage back, the next epoch reads in full


# --- advise ---------------------------------------------------------------------------------


def test_advise_measures_hdfs(hdfs, hdfs_images, capsys):
    assert cli.main(["advise", hdfs_images, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    dataset, store = report["measured"]["dataset"], report["measured"]["storage"]
    assert dataset["samples"] == 60 and dataset["format"] == "images"
    assert store["latency_s"] > 0 and store["bandwidth_bytes_per_s"] > 0
    advice = {a["setting"]: a for a in report["advice"]}
    assert set(advice) >= {"pack", "cache", "read_concurrency", "block_rows"}
    assert all(a["reason"] and a["measured"] for a in advice.values())


# --- what libhdfs needs, one piece taken away at a time ---------------------------------------

PROBE = r"""
import sys
import tempfile
import raying
try:
    m = raying.Manifest.scan(sys.argv[1])
    print("OK", len(m))
except raying.RayingError as exc:
    print(type(exc).__name__, exc)
"""

# pyarrow alone, without raying's checks: what the user would get otherwise.
BARE = r"""
import sys
import tempfile
import pyarrow.fs as pafs
try:
    fs = pafs.HadoopFileSystem("127.0.0.1", int(sys.argv[1]))
    infos = fs.get_file_info(pafs.FileSelector("/data/images", recursive=True))
    print("OK", sum(i.type == pafs.FileType.File for i in infos))
except Exception as exc:
    print("FAILED", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
"""


def _run(code: str, arg: str, env: dict[str, str]) -> str:
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.run([sys.executable, "-c", code, arg], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    out = proc.stdout.strip()
    assert out, proc.stderr[-2000:]
    return out


def test_missing_pieces_of_a_real_setup_are_named(hdfs, hdfs_images, tmp_path):
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("HADOOP_HOME", "LD_LIBRARY_PATH", "RAY_ADDRESS"):
        base.pop(name, None)
    lib = hdfs.install.lib
    (tmp_path / "jre" / "bin").mkdir(parents=True)  # a Java folder without libjvm
    cases = {
        "complete": ({}, r"^OK 60$"),
        "JAVA_HOME unset": ({"JAVA_HOME": None},
                            r"^DependencyError HDFS needs Java, but JAVA_HOME is not set"),
        "JAVA_HOME without libjvm": (
            {"JAVA_HOME": str(tmp_path / "jre")},
            r"^DependencyError HDFS needs Java, but JAVA_HOME=.*jre' holds no libjvm\.so"),
        "no libhdfs": ({"ARROW_LIBHDFS_DIR": None},
                       r"^DependencyError HDFS needs libhdfs\.so, which was not found in "
                       r"ARROW_LIBHDFS_DIR \(not set\)"),
        "CLASSPATH unset": ({"CLASSPATH": None},
                            r"^DependencyError HDFS needs the Hadoop jars on CLASSPATH, which "
                            r"is not set; fix: export CLASSPATH=\$\(\$HADOOP_HOME/bin/hadoop "
                            r"classpath --glob\)"),
        "CLASSPATH wildcard": ({"CLASSPATH": f"{hdfs.conf}:{lib}/*"},
                               r"^DependencyError .*holds wildcard entries \(dir/\*\) that "
                               r"libhdfs does not expand"),
    }
    if ctypes.util.find_library("hdfs"):  # a system-wide libhdfs: nothing to take away
        del cases["no libhdfs"]
    for what, (change, pattern) in cases.items():
        out = _run(PROBE, hdfs_images, {**base, **change})
        assert re.search(pattern, out), (what, out)
    # The checks name real failures: pyarrow alone, given the same environments, fails too
    # (and succeeds given the complete one).
    port = str(hdfs.port)
    assert _run(BARE, port, base) == "OK 60"
    bare = [({"CLASSPATH": None}, "FAILED OSError HDFS connection failed"),
            ({"CLASSPATH": f"{hdfs.conf}:{lib}/*"}, "FAILED OSError HDFS connection failed"),
            ({"ARROW_LIBHDFS_DIR": None}, "FAILED OSError Unable to load libhdfs"),
            ({"JAVA_HOME": str(tmp_path / "jre")}, "FAILED OSError Unable to load libjvm")]
    for change, expected in bare:
        assert _run(BARE, port, {**base, **change}) == expected, change


def test_a_namenode_that_does_not_answer_is_named_not_a_missing_path(hdfs, hdfs_images):
    """libhdfs connects lazily and reports a path it cannot ask about as missing: a scan of a
    port where no NameNode listens says it cannot connect there; a path that is missing on
    the live cluster still says so."""
    from tests.hdfscluster import free_port

    port = free_port()
    with pytest.raises(raying.StorageError,
                       match=rf"cannot connect to HDFS at 127\.0\.0\.1:{port} to reach "
                             rf"hdfs://127\.0\.0\.1:{port}/ds .*NameNode is up") as info:
        raying.Manifest.scan(f"hdfs://127.0.0.1:{port}/ds")
    # An outage, not a property of the path: a read that meets it stops its unit, whatever
    # on_error says (raying.storage.files.refuse_outage), rather than setting the file aside.
    assert info.value.outage
    with pytest.raises(raying.StorageError, match=r"/nope/ds does not exist; check the path"):
        raying.Manifest.scan(hdfs.uri("/nope/ds"))
    assert len(raying.Manifest.scan(hdfs_images)) == 60


def test_the_daemons_leave_nothing_in_the_system_temp_folder(hdfs):
    """The web servers' unpacked files lie in the cluster's folder (removed with it), and no
    JVM writes a perf-data file that a killed process would leave behind."""
    assert list(hdfs.tmp.glob("Jetty_*")), "the daemons' web servers unpacked elsewhere"
    system = Path(tempfile.gettempdir())
    for proc in (hdfs.namenode, hdfs.datanode):
        assert proc is not None and proc.poll() is None
        assert not list(system.glob(f"hsperfdata_*/{proc.pid}"))
        assert not [p for p in system.glob("Jetty_*")
                    if f"_{hdfs.datanode_ports['http.address']}_" in p.name]


def test_a_folder_hdfs_refuses_to_list_is_named_not_a_missing_path(hdfs, hdfs_images):
    """libhdfs reports a path under a folder this user may not list (mode 700, another
    owner) as missing: the scan names the folder HDFS refused and the fix instead."""
    hdfs.shell("-mkdir", "-p", "/secret/imgs")
    hdfs.shell("-chmod", "700", "/secret")
    as_alice = f"hdfs://alice@127.0.0.1:{hdfs.port}"
    with pytest.raises(raying.CredentialsError,
                       match=rf"HDFS refused access to {as_alice}/secret \(.*\); check the "
                             rf"HDFS user \(storage=\{{'hdfs_user': ...\}} or HADOOP_USER_NAME\)"):
        raying.Manifest.scan(f"{as_alice}/secret/imgs")
    # A path missing where alice may look is still missing; what she may read she reads.
    with pytest.raises(raying.StorageError, match=r"/nope/ds does not exist; check the path"):
        raying.Manifest.scan(f"{as_alice}/nope/ds")
    path = hdfs_images.split(str(hdfs.port), 1)[1]
    assert len(raying.Manifest.scan(f"{as_alice}{path}")) == 60
