"""Unit tests of raying.storage.files (URIs, options, redaction, local I/O), the HDFS checks and the
slow-storage simulator; no network, no Ray."""

from __future__ import annotations

import logging
import os
import pickle
import re
import sys
import threading
import time

import pyarrow.fs as pafs
import pytest

from raying.errors import ConfigError, CredentialsError, DependencyError, StorageError
from raying.storage import errors as _errors
from raying.storage import files as storage
from raying.storage import hdfs as _hdfs
from raying.storage import s3 as _s3
from raying.storage import slow
from raying.storage.errors import storage_error
from raying.storage.files import NotFoundError, StorageSpec

CANARY = "CANARY-secret-5f1e2d3c4b5a69788796"
CANARY_KEY_ID = "AKIACANARYKEYID12345"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    storage.clear_cache()
    yield
    storage.clear_cache()


@pytest.fixture
def tree(tmp_path):
    """cats/{1,2}.jpg, dogs/3.PNG, dogs/notes.txt, and hidden things that must not list."""
    for rel, data in {"cats/1.jpg": b"a" * 10, "cats/2.jpg": b"b" * 20, "dogs/3.PNG": b"c" * 30,
                      "dogs/notes.txt": b"n", ".git/x.jpg": b"h", "_tmp/y.jpg": b"h",
                      "cats/.DS_Store": b"h", "_SUCCESS": b""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    return tmp_path


# --- URIs -----------------------------------------------------------------------------------


def test_plain_paths_resolve_to_local_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = storage.resolve("data/x")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == str(tmp_path / "data" / "x")
    assert storage.resolve("~/x")[1] == os.path.expanduser("~/x")
    assert storage.resolve(tmp_path / "p")[1] == str(tmp_path / "p")


@pytest.mark.parametrize(("uri", "path"), [
    ("file:///tmp/a%20b/c", "/tmp/a b/c"),
    ("file://localhost/tmp/x", "/tmp/x"),
    ("FILE:///tmp/x", "/tmp/x"),
])
def test_file_uris(uri, path):
    spec, got = StorageSpec.from_uri(uri)
    assert (spec.scheme, got) == ("file", path)


def test_file_uri_with_a_remote_host_is_refused():
    with pytest.raises(ConfigError, match="names host 'server'; only local files"):
        StorageSpec.from_uri("file://server/share/x")


@pytest.mark.parametrize(("uri", "path"), [
    ("s3://bucket/a/b.jpg", "bucket/a/b.jpg"),
    ("s3://bucket/prefix/", "bucket/prefix"),
    ("s3://bucket", "bucket"),
    ("s3a://bucket/k", "bucket/k"),
    # "#" and "?" are a key's characters (a run named "run #3"), unless they start pyarrow's
    # settings query.
    ("s3://bucket/run #3/a.jpg", "bucket/run #3/a.jpg"),
    ("s3://bucket/q?x/a.jpg", "bucket/q?x/a.jpg"),
    ("s3://bucket/what?region", "bucket/what?region"),
])
def test_s3_uris(uri, path):
    spec, got = StorageSpec.from_uri(uri, {"endpoint_url": "http://127.0.0.1:9"})
    assert (spec.scheme, got) == ("s3", path)
    assert spec.uri(got) == "s3://" + path


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "s3://b/k?endpoint_override=x",
                                 "s3://b/k?region=eu-west-1&scheme=http", "s3://b?x/k"])
def test_malformed_s3_uris(uri):
    with pytest.raises(ConfigError, match="must look like s3://bucket/key"):
        StorageSpec.from_uri(uri)


@pytest.mark.parametrize(("uri", "expected"), [
    ("hdfs://namenode:9000/data/x", ("namenode", 9000, "/data/x", None)),
    ("hdfs://namenode/data", ("namenode", 8020, "/data", None)),
    ("hdfs:///data/x", ("default", 0, "/data/x", None)),
    ("hdfs://alice@nn:8021/d", ("nn", 8021, "/d", "alice")),
    ("hdfs://nn:8020", ("nn", 8020, "/", None)),
])
def test_hdfs_uris(uri, expected):
    assert _hdfs.parse_hdfs_uri(uri) == expected


def test_hdfs_spec_carries_host_port_and_user():
    spec, path = StorageSpec.from_uri("hdfs://alice@nn:8021/d")
    assert (spec.host, spec.port, spec.options.hdfs_user, path) == ("nn", 8021, "alice", "/d")
    assert spec.uri(path) == "hdfs://nn:8021/d"
    spec, path = StorageSpec.from_uri("hdfs:///d", {"hdfs_user": "bob"})
    assert (spec.host, spec.options.hdfs_user, spec.uri(path)) == ("default", "bob", "hdfs:///d")


@pytest.mark.parametrize("uri", ["hdfs://nn:99999/x", "hdfs://nn:port/x"])
def test_hdfs_bad_port(uri):
    with pytest.raises(ConfigError, match="has an invalid port; expected hdfs://host:port/path"):
        _hdfs.parse_hdfs_uri(uri)


@pytest.mark.parametrize("scheme", ["gs", "az", "http", "ftp"])
def test_unknown_schemes_name_the_scheme_and_the_supported_ones(scheme):
    msg = (rf"URI scheme '{scheme}://' in '{scheme}://b/x' is not supported; raying reads "
           r"local paths, file://, s3://")
    with pytest.raises(ConfigError, match=msg):
        storage.resolve(f"{scheme}://b/x")


def test_empty_uri():
    with pytest.raises(ConfigError, match="uri must be a non-empty path or URI string"):
        storage.resolve("")


# --- options --------------------------------------------------------------------------------


def test_dict_options_and_aliases_coerce():
    spec, _ = StorageSpec.from_uri("s3://b/k", {"endpoint": "http://h:1", "key": "AKIAX",
                                                "secret": CANARY, "region": "eu-west-1"})
    o = spec.options
    assert (o.endpoint_url, o.access_key_id, o.secret_access_key, o.region) == (
        "http://h:1", "AKIAX", CANARY, "eu-west-1")


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="storage option 'endpointurl' is not known"):
        storage.resolve("s3://b/k", {"endpointurl": "http://h"})


def test_endpoint_needs_a_scheme():
    with pytest.raises(ConfigError, match=r"endpoint_url must look like http://host:port"):
        storage.resolve("s3://b/k", {"endpoint_url": "127.0.0.1:9000"})


@pytest.mark.parametrize(("options", "match"), [
    ({"access_key_id": "AKIAX"}, "access_key_id is set but secret_access_key is not"),
    ({"secret_access_key": CANARY}, "secret_access_key is set but access_key_id is not"),
    ({"anonymous": True, "profile": "p"}, "anonymous=True cannot be combined"),
])
def test_inconsistent_credentials(options, match):
    with pytest.raises(ConfigError, match=match) as info:
        storage.resolve("s3://b/k", {"endpoint_url": "http://h:1", **options})
    assert CANARY not in str(info.value)


def test_endpoint_and_region_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    spec, _ = StorageSpec.from_uri("s3://b/k")
    assert (spec.options.endpoint_url, spec.options.region) == ("http://generic:1", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3only:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    assert StorageSpec.from_uri("s3://b/k")[0].options.endpoint_url == "https://s3only:2"
    assert StorageSpec.from_uri("s3://b/k")[0].options.region == "eu-central-1"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert StorageSpec.from_uri("s3://b/k")[0].options.region == "ap-south-1"
    explicit = {"endpoint_url": "http://mine:3", "region": "us-west-2"}
    opts = StorageSpec.from_uri("s3://b/k", explicit)[0].options
    assert (opts.endpoint_url, opts.region) == ("http://mine:3", "us-west-2")


def test_s3_filesystems_are_cached_per_options():
    a, _ = storage.resolve("s3://b/k", {"endpoint_url": "http://127.0.0.1:9"})
    b, _ = storage.resolve("s3://other/k", {"endpoint_url": "http://127.0.0.1:9"})
    c, _ = storage.resolve("s3://b/k", {"endpoint_url": "http://127.0.0.1:10"})
    assert a is b
    assert a is not c
    assert storage.resolve("/tmp")[0] is storage.resolve("/var")[0]


def test_profile_is_resolved_through_botocore(tmp_path, monkeypatch):
    (tmp_path / "credentials").write_text(
        f"[team]\naws_access_key_id = {CANARY_KEY_ID}\naws_secret_access_key = {CANARY}\n")
    (tmp_path / "config").write_text("[profile team]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    keys, region = _s3.profile_credentials("team")
    assert (keys["access_key"], keys["secret_key"], region) == (CANARY_KEY_ID, CANARY, "eu-west-3")
    fs, _ = storage.resolve("s3://b/k", {"profile": "team", "endpoint_url": "http://h:1"})
    assert isinstance(fs, pafs.S3FileSystem)
    with pytest.raises(ConfigError, match="AWS profile 'nope' is not in the AWS config files"):
        storage.resolve("s3://b/k", {"profile": "nope", "endpoint_url": "http://h:1"})


def test_profile_without_botocore_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "botocore", None)
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(DependencyError, match=r"needs botocore .* pip install boto3"):
        storage.resolve("s3://b/k", {"profile": "team", "endpoint_url": "http://h:1"})


# --- secrets --------------------------------------------------------------------------------


def test_secrets_travel_in_pickles_but_never_show(caplog):
    options = {"endpoint_url": "http://127.0.0.1:9", "access_key_id": CANARY_KEY_ID,
               "secret_access_key": CANARY, "session_token": CANARY + "tok"}
    spec, _ = StorageSpec.from_uri("s3://b/k", options)
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec
    assert again.options.secret_access_key == CANARY
    for text in (repr(spec), str(spec), repr(spec.options), str(spec.options.public_dict())):
        assert CANARY not in text
        assert CANARY_KEY_ID not in text
    assert "secrets=<redacted>" in repr(spec)


def test_error_text_is_scrubbed_of_secrets(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY)
    fs = pafs.S3FileSystem(endpoint_override="127.0.0.1:9", scheme="http", region="us-east-1")
    err = storage_error(OSError(f"AWS Error SOMETHING with {CANARY} inside"), fs, "b/k")
    assert isinstance(err, StorageError)
    assert CANARY not in str(err)
    assert "***" in str(err)


def test_credentials_source_never_prints_values(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    assert _s3.credentials_source(None) == (
        "no AWS credentials were found in the environment or the shared config files")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CANARY_KEY_ID)
    assert CANARY_KEY_ID not in _s3.credentials_source(None)


# --- local I/O ------------------------------------------------------------------------------


def test_list_files_sorted_sized_and_without_hidden(tree):
    fs, root = storage.resolve(str(tree))
    infos = storage.list_files(fs, root)
    rel = [(os.path.relpath(i.path, root), i.size) for i in infos]
    assert rel == [("cats/1.jpg", 10), ("cats/2.jpg", 20), ("dogs/3.PNG", 30),
                   ("dogs/notes.txt", 1)]


def test_list_files_filters_extensions_case_insensitively(tree):
    fs, root = storage.resolve(str(tree))
    names = [os.path.basename(i.path) for i in
             storage.list_files(fs, root, extensions=[".jpg", "png"])]
    assert names == ["1.jpg", "2.jpg", "3.PNG"]
    assert storage.list_files(fs, root, extensions=".txt")[0].path.endswith("notes.txt")
    assert storage.list_files(fs, root, recursive=False) == []


def test_list_files_of_a_file_and_of_nothing(tree):
    fs, root = storage.resolve(str(tree))
    [info] = storage.list_files(fs, f"{root}/cats/1.jpg")
    assert info.size == 10
    with pytest.raises(NotFoundError, match=f"{root}/missing does not exist"):
        storage.list_files(fs, f"{root}/missing")


def test_read_bytes_and_missing_files_are_not_retried(tree):
    fs, root = storage.resolve(str(tree))
    assert storage.read_bytes(fs, f"{root}/cats/2.jpg") == b"b" * 20
    retries = []
    with pytest.raises(NotFoundError, match="cats/nope.jpg does not exist") as info:
        storage.read_bytes(fs, f"{root}/cats/nope.jpg", on_retry=lambda *a: retries.append(a))
    assert retries == []
    assert isinstance(info.value, FileNotFoundError)


def test_read_many_keeps_order_and_failures_in_their_slots(tree):
    fs, root = storage.resolve(str(tree))
    paths = [f"{root}/cats/1.jpg", f"{root}/nope", f"{root}/dogs/3.PNG"]
    out = storage.read_many(fs, paths)
    assert out[0] == b"a" * 10 and out[2] == b"c" * 30
    assert isinstance(out[1], NotFoundError)
    infos = storage.list_files(fs, root)
    assert storage.read_many(fs, infos) == [storage.read_bytes(fs, i.path) for i in infos]


def test_a_file_that_became_a_pipe_or_a_device_is_refused_at_once(tree, monkeypatch):
    """A named pipe where a file was blocked the read (and its epoch) until a writer came; a
    link to /dev/zero filled the read worker's memory: each is refused in its slot, naming
    the file, and the others are read."""
    from raying.errors import DataError

    fs, root = storage.resolve(str(tree))
    os.remove(f"{root}/cats/1.jpg")
    os.mkfifo(f"{root}/cats/1.jpg")
    os.symlink("/dev/zero", f"{root}/cats/zero.jpg")
    paths = [f"{root}/cats/1.jpg", f"{root}/cats/zero.jpg", f"{root}/cats/2.jpg"]
    out: list = []
    reader = threading.Thread(target=lambda: out.extend(storage.read_many(fs, paths)),
                              daemon=True)
    reader.start()
    reader.join(10.0)
    assert not reader.is_alive(), "the read waits on the pipe"
    assert isinstance(out[0], DataError) and "1.jpg is not a regular file but a named pipe" \
        in str(out[0])
    assert isinstance(out[1], DataError) and "zero.jpg is not a regular file but a device" \
        in str(out[1])
    assert out[2] == b"b" * 20
    monkeypatch.setattr(storage, "MAX_LOCAL_READ_BYTES", 19)  # a file grown past the limit
    with pytest.raises(DataError, match=r"2\.jpg holds 20 bytes, more than the 19"):
        storage.read_bytes(fs, f"{root}/cats/2.jpg")
    with pytest.raises(StorageError):  # a folder stays the storage's error, as before
        storage.read_bytes(fs, f"{root}/cats")


def test_write_bytes_atomic_local(tmp_path):
    fs, root = storage.resolve(str(tmp_path))
    target = f"{root}/deep/er/file.bin"
    storage.write_bytes_atomic(fs, target, b"one")
    storage.write_bytes_atomic(fs, target, memoryview(b"two"))
    assert open(target, "rb").read() == b"two"
    assert os.listdir(os.path.dirname(target)) == ["file.bin"]
    assert storage.exists(fs, target) and storage.exists(fs, f"{root}/deep")
    assert not storage.exists(fs, f"{root}/nothing")


def test_write_bytes_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    fs, root = storage.resolve(str(tmp_path))
    target = f"{root}/file.bin"
    storage.write_bytes_atomic(fs, target, b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StorageError, match=r"cannot write .*file.bin: \[Errno 28\] No space"):
        storage.write_bytes_atomic(fs, target, b"new")
    assert open(target, "rb").read() == b"old"
    assert os.listdir(root) == ["file.bin"]


def test_permission_errors_are_credentials_errors():
    local = storage_error(PermissionError(13, "Permission denied"), pafs.LocalFileSystem(), "/x")
    assert isinstance(local, CredentialsError)
    assert str(local) == "permission denied to read /x; check the file's owner and mode"


def test_unreadable_local_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    locked = tmp_path / "locked"
    locked.write_bytes(b"x")
    locked.chmod(0)
    fs, path = storage.resolve(str(locked))
    with pytest.raises(CredentialsError, match="permission denied to read"):
        storage.read_bytes(fs, path)


def test_helpers_for_direct_pyarrow_callers(tree):
    fs, root = storage.resolve(str(tree))
    assert storage.file_info(fs, f"{root}/cats/1.jpg").size == 10
    assert storage.file_info(fs, f"{root}/nope").type == pafs.FileType.NotFound
    with storage.open_input(fs, f"{root}/dogs/3.PNG") as f:
        assert f.read_at(2, 28) == b"cc"
    with pytest.raises(NotFoundError, match="nope does not exist"):
        storage.open_input(fs, f"{root}/nope")
    storage.make_dirs(fs, f"{root}/new/deeper")
    assert os.path.isdir(f"{root}/new/deeper")
    err = storage.storage_error(FileNotFoundError(2, "gone"), "s3://bucket/key")
    assert isinstance(err, NotFoundError)
    assert str(err) == "s3://bucket/key does not exist; check the path"
    refused = OSError("AWS Error ACCESS_DENIED during HeadObject operation")
    assert storage.is_credentials_error(refused)
    assert not storage.is_credentials_error(OSError("AWS Error NETWORK_CONNECTION"))
    assert isinstance(storage.storage_error(refused, "s3://bucket/key"), CredentialsError)


# --- retries --------------------------------------------------------------------------------


class _Flaky(pafs.FileSystemHandler):
    """Local files whose first ``failures`` opens fail with a network error."""

    def __init__(self, failures: int, message: str) -> None:
        self.failures, self.message, self.opens = failures, message, 0
        self.base = pafs.LocalFileSystem()

    def open_input_stream(self, path):
        self.opens += 1
        if self.opens <= self.failures:
            raise OSError(self.message)
        return self.base.open_input_stream(path)

    def get_type_name(self):
        return "flaky"

    def normalize_path(self, path):
        return path

    def equals(self, other):
        return self is other

    def get_file_info(self, paths):
        return self.base.get_file_info(paths)

    get_file_info_selector = create_dir = delete_dir = delete_dir_contents = None
    delete_root_dir_contents = delete_file = move = copy_file = open_input_file = None
    open_output_stream = open_append_stream = None


NETWORK_ERROR = "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7"


def test_transient_errors_are_retried_with_backoff(tree):
    handler = _Flaky(2, NETWORK_ERROR)
    fs = pafs.PyFileSystem(handler)
    seen = []
    data = storage.read_bytes(fs, f"{tree}/cats/1.jpg", retries=3, backoff=0.001,
                              on_retry=lambda path, attempt, exc: seen.append(attempt))
    assert data == b"a" * 10
    assert seen == [1, 2]


def test_retries_give_up_with_the_uri_and_the_count(tree, caplog):
    fs = pafs.PyFileSystem(_Flaky(10, NETWORK_ERROR))
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        with pytest.raises(StorageError, match=r"cannot read .*1.jpg \(after 3 attempts\)"):
            storage.read_bytes(fs, f"{tree}/cats/1.jpg", retries=3, backoff=0.001)
    assert len([r for r in caplog.records if "retrying" in r.message]) == 2


class _Outage(_Flaky):
    """Local files; opens of the files named in ``down`` fail until ``failures`` of them did."""

    def __init__(self, failures: int, down: set[str]) -> None:
        super().__init__(failures, NETWORK_ERROR)
        self.down = down

    def open_input_stream(self, path):
        if path.rsplit("/", 1)[-1] in self.down and self.opens < self.failures:
            self.opens += 1
            raise OSError(self.message)
        return self.base.open_input_stream(path)


def test_a_short_outage_that_outlasts_one_read_s_retries_loses_no_file(tree):
    """Two of four reads fail 3 times each (an outage longer than their 3 attempts): their
    second round, once the others are done, reads them; a missing file is not retried."""
    fs = pafs.PyFileSystem(_Outage(6, {"1.jpg", "2.jpg"}))
    names = [f"{tree}/cats/1.jpg", f"{tree}/cats/2.jpg", f"{tree}/dogs/3.PNG",
             f"{tree}/cats/none.jpg"]
    got = storage.read_many(fs, names, retries=3, backoff=0.001)
    assert got[:3] == [storage.read_bytes(pafs.LocalFileSystem(), n) for n in names[:3]]
    assert isinstance(got[3], NotFoundError)
    # Still failing after the second round: the error is returned in its slot.
    fs = pafs.PyFileSystem(_Outage(100, {"1.jpg"}))
    got = storage.read_many(fs, names[:3], retries=3, backoff=0.001)
    assert isinstance(got[0], StorageError) and got[1:] == [
        storage.read_bytes(pafs.LocalFileSystem(), n) for n in names[1:3]]


class _Down(_Flaky):
    """Every open fails with ``message`` after ``delay_s`` (a client waiting out its own
    retries before it gives up); opens are counted."""

    def __init__(self, message: str, delay_s: float) -> None:
        super().__init__(10**9, message)
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def open_input_stream(self, path):
        with self.lock:
            self.opens += 1
        time.sleep(self.delay_s)
        raise OSError(self.message)


def test_a_unit_whose_first_wave_of_reads_all_failed_starts_no_more(tree, monkeypatch):
    """Storage that fails every read, each after its client's own retries (HDFS with no live
    DataNode: ~20 s a read with Hadoop's defaults): a unit of 40 files waited for every one,
    minutes in all. Once the first wave (one read per thread) failed and none succeeded, the
    rest are not started and the unit is refused as an outage, naming the first error."""
    handler = _Down("HDFS read failed, errno: 255 (Input/output error)", 0.05)
    fs = pafs.PyFileSystem(handler)
    names = [f"{tree}/cats/1.jpg"] * 40
    got = storage.read_many(fs, names, threads=4, retries=2, backoff=0.001)
    assert all(isinstance(g, StorageError) for g in got)
    assert handler.opens <= (2 * 4 + 4) * 2, handler.opens  # two waves' attempts, and a few
    opened = handler.opens
    time.sleep(0.3)  # the reads still running when the unit gave up make no other attempt
    assert handler.opens == opened
    # Every read of the first two waves (2 x 4 threads) fails before the rest are refused;
    # a third-wave read that fails in the same wait is counted too.
    said = re.search(r"not read: the (\d+) reads before it in this unit failed on the storage",
                     str(got[-1]))
    assert said and int(said.group(1)) >= 8, str(got[-1])
    with pytest.raises(StorageError, match=r"none of the \d+ reads made of this unit's 40 "
                                           r"succeeded \(the other \d+ were not started\); "
                                           r"the first failed with: cannot read .*"
                                           r"check the endpoint and the credentials"):
        storage.refuse_outage(got)
    # A failure among reads that succeed is its file's: every read is made.
    handler = _Outage(2, {"1.jpg"})
    fs = pafs.PyFileSystem(handler)
    names = [f"{tree}/cats/1.jpg"] + [f"{tree}/cats/2.jpg"] * 11
    got = storage.read_many(fs, names, threads=4, retries=1, backoff=0.001)
    assert isinstance(got[0], StorageError) and got[1:] == [b"b" * 20] * 11


def test_a_read_backing_off_when_its_unit_gives_up_makes_no_other_attempt(tree):
    """The unit gives up (``ABANDONED`` set) while a read waits out its backoff: the read ends
    then, with its error, and opens nothing more."""
    import threading

    from raying.storage import errors as storage_errors

    handler = _Down("HDFS read failed, errno: 255 (Input/output error)", 0.0)
    fs = pafs.PyFileSystem(handler)
    abandoned = threading.Event()
    token = storage_errors.ABANDONED.set(abandoned)
    timer = threading.Timer(0.05, abandoned.set)  # backoff 1-2 s: set during the first one
    timer.start()
    try:
        began = time.monotonic()
        with pytest.raises(StorageError, match="Input/output error"):
            storage.read_bytes(fs, f"{tree}/cats/1.jpg", retries=3, backoff=2.0)
        took = time.monotonic() - began
    finally:
        timer.cancel()
        storage_errors.ABANDONED.reset(token)
    time.sleep(0.1)
    assert handler.opens == 1, handler.opens
    assert took < 0.9, took  # ended as the unit gave up, not after the backoff


def test_attempts_the_storage_client_retried_itself_end_after_the_second(tree, monkeypatch,
                                                                         caplog):
    """Each attempt against HDFS of no live DataNode fails only after Hadoop's own retries
    (~20 s with its defaults): five attempts made a read wait ~2 minutes. A second attempt
    that fails that slowly ends the read (a first may meet an outage that then ends)."""
    monkeypatch.setattr(_errors, "SLOW_ATTEMPT_S", 0.05)
    monkeypatch.setattr(_errors, "_last_retry_warning", [-1e9])
    handler = _Down("HDFS read failed, errno: 255", 0.06)
    with caplog.at_level(logging.WARNING, logger="raying.storage.files"):
        with pytest.raises(StorageError, match=r"\(after 2 attempts\)"):  # a read task's
            storage.read_bytes(pafs.PyFileSystem(handler), f"{tree}/cats/1.jpg", retries=5,
                               backoff=0.001, on_retry=lambda *a: None)
        assert handler.opens == 2
        assert "not retried again: two attempts in a row failed only after" in caplog.text
        caplog.clear()
        with pytest.raises(StorageError, match=r"\(after 2 attempts\)"):  # said once per 30 s
            storage.read_bytes(pafs.PyFileSystem(handler), f"{tree}/cats/2.jpg", retries=5,
                               backoff=0.001, on_retry=lambda *a: None)
        assert not caplog.text

    class _FastThenSlow(_Down):  # a blip, then the storage client's own long wait
        def open_input_stream(self, path):
            self.delay_s = 0.0 if self.opens == 0 else 0.06
            return super().open_input_stream(path)

    handler = _FastThenSlow("HDFS read failed, errno: 255", 0.0)
    with pytest.raises(StorageError, match=r"\(after 3 attempts\)"):  # two slow in a row
        storage.read_bytes(pafs.PyFileSystem(handler), f"{tree}/cats/1.jpg", retries=5,
                           backoff=0.001)
    assert handler.opens == 3
    handler = _Down("HDFS read failed, errno: 255", 0.0)  # fast failures: every attempt
    with pytest.raises(StorageError, match=r"\(after 5 attempts\)"):
        storage.read_bytes(pafs.PyFileSystem(handler), f"{tree}/cats/1.jpg", retries=5,
                           backoff=0.001)
    assert handler.opens == 5


class _BadFirst(_Flaky):
    """Opens of ``1.jpg`` fail after ``delay_s`` (a lost block: one file's); others read."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(0, "HDFS read failed, errno: 255")
        self.delay_s = delay_s

    def open_input_stream(self, path):
        if path.endswith("/1.jpg"):
            time.sleep(self.delay_s)
            raise OSError(self.message)
        return self.base.open_input_stream(path)


def test_a_first_wave_of_bad_files_does_not_stop_the_unit(tree):
    """A unit whose first reads are all bad files (a lost block each) reads the rest: one
    failed wave is no outage, and its good files are not given up unread."""
    fs = pafs.PyFileSystem(_BadFirst(0.2))
    names = [f"{tree}/cats/1.jpg"] * 4 + [f"{tree}/cats/2.jpg"] * 12
    got = storage.read_many(fs, names, threads=4, retries=1, backoff=0.001)
    assert all(isinstance(g, StorageError) for g in got[:4])
    assert got[4:] == [b"b" * 20] * 12
    storage.refuse_outage(got)  # bad files among good ones: not an outage


def test_an_hdfs_unit_that_read_nothing_names_the_datanodes():
    err = StorageError("cannot read hdfs://nn:9000/data/a.jpg (after 5 attempts): HDFS read "
                       "failed")
    with pytest.raises(StorageError, match=r"check that the DataNodes are up \(hdfs dfsadmin "
                                           r"-report lists the live ones\)"):
        storage.refuse_outage([err, err])


def test_no_second_round_when_every_read_failed(tree):
    """Every read failing is an outage the caller reports at once: one round only."""
    handler = _Outage(100, {"1.jpg", "2.jpg"})
    got = storage.read_many(pafs.PyFileSystem(handler),
                            [f"{tree}/cats/1.jpg", f"{tree}/cats/2.jpg"], retries=3,
                            backoff=0.001)
    assert all(isinstance(g, StorageError) for g in got)
    assert handler.opens == 6


def test_refusals_are_not_retried(tree):
    handler = _Flaky(10, "AWS Error ACCESS_DENIED during HeadObject operation")
    with pytest.raises(CredentialsError):
        storage.read_bytes(pafs.PyFileSystem(handler), f"{tree}/cats/1.jpg", backoff=0.001)
    assert handler.opens == 1


def test_retries_must_be_positive(tree):
    fs, root = storage.resolve(str(tree))
    with pytest.raises(ConfigError, match="retries must be >= 1"):
        storage.read_bytes(fs, f"{root}/cats/1.jpg", retries=0)


# --- HDFS environment -----------------------------------------------------------------------


@pytest.fixture
def hadoop(tmp_path):
    """A fake but complete environment: a JDK with libjvm, libhdfs, and Hadoop jars."""
    jdk = tmp_path / "jdk"
    (jdk / "lib" / "server").mkdir(parents=True)
    (jdk / "lib" / "server" / "libjvm.so").write_bytes(b"")
    native = tmp_path / "hadoop" / "lib" / "native"
    native.mkdir(parents=True)
    (native / "libhdfs.so").write_bytes(b"")
    jar = tmp_path / "hadoop" / "hadoop-common-3.3.6.jar"
    jar.write_bytes(b"")
    return {"JAVA_HOME": str(jdk), "HADOOP_HOME": str(tmp_path / "hadoop"),
            "CLASSPATH": f"/etc/hadoop:{jar}"}


def test_hdfs_environment_complete(hadoop):
    _hdfs.check_hdfs_environment(hadoop)


@pytest.mark.parametrize(("change", "match"), [
    ({"JAVA_HOME": None}, "HDFS needs Java, but JAVA_HOME is not set; install a JDK"),
    ({"JAVA_HOME": "/no/such/jdk"}, "JAVA_HOME='/no/such/jdk' is not a directory"),
    ({"JAVA_HOME": "EMPTY"}, r"JAVA_HOME='.*' holds no libjvm.so .* point JAVA_HOME at a full"),
    ({"HADOOP_HOME": None}, r"HDFS needs libhdfs.so, which was not found in ARROW_LIBHDFS_DIR "
                            r"\(not set\); HADOOP_HOME/lib/native \(HADOOP_HOME not set\)"),
    ({"CLASSPATH": None}, r"Hadoop jars on CLASSPATH, which is not set; fix: export "
                          r"CLASSPATH=\$\(\$HADOOP_HOME/bin/hadoop classpath --glob\)"),
    ({"CLASSPATH": "/opt/hadoop/share/hadoop/common/*"}, r"wildcard entries .* --glob"),
    ({"CLASSPATH": "/etc/hadoop:/x/other.jar"}, r"holds none \(no hadoop-\*.jar among 2"),
])
def test_hdfs_environment_errors_name_the_missing_piece(hadoop, tmp_path, monkeypatch, change,
                                                       match):
    monkeypatch.setattr(_hdfs.ctypes.util, "find_library", lambda name: None)
    env = dict(hadoop)
    for name, value in change.items():
        if value is None:
            env.pop(name)
        elif value == "EMPTY":
            (tmp_path / "empty-jdk").mkdir()
            env[name] = str(tmp_path / "empty-jdk")
        else:
            env[name] = value
    with pytest.raises(DependencyError, match=match):
        _hdfs.check_hdfs_environment(env)


def test_arrow_libhdfs_dir_is_enough(hadoop, tmp_path, monkeypatch):
    env = dict(hadoop)
    env["ARROW_LIBHDFS_DIR"] = str(tmp_path / "hadoop" / "lib" / "native")
    env.pop("HADOOP_HOME")
    _hdfs.check_hdfs_environment(env)


def test_resolve_hdfs_checks_the_environment_first(monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(DependencyError, match="JAVA_HOME is not set"):
        storage.resolve("hdfs://namenode:8020/data")


def test_hdfs_connect_failure_is_a_storage_error(hadoop, monkeypatch):
    for name, value in hadoop.items():
        monkeypatch.setenv(name, value)
    # The fake libhdfs.so is empty, so pyarrow fails to load it: a StorageError, not a crash.
    with pytest.raises(StorageError, match="cannot connect to HDFS at namenode:8020"):
        storage.resolve("hdfs://namenode:8020/data")


# --- slow-storage simulator -----------------------------------------------------------------


def test_slow_tier_coercion():
    assert slow.coerce_tier((0.005, 50e6)) == slow.SlowTier(0.005, 50e6)
    assert slow.coerce_tier([0, None, 1]) == slow.SlowTier(0.0, None, 1)
    assert slow.coerce_tier("hdd").concurrency == 1
    with pytest.raises(ConfigError, match=r"slow must be \(latency_s, bandwidth_bytes_per_s"):
        slow.coerce_tier((1,))
    with pytest.raises(ConfigError, match="slow tier 'tape' is not known"):
        slow.coerce_tier("tape")
    with pytest.raises(ConfigError, match="latency_s must be >= 0 seconds, got -1"):
        slow.SlowTier(-1)


def test_slow_filesystem_counts_requests_and_bytes(tree):
    fs, root = storage.resolve(str(tree), {"slow": (0.0, None)})
    counters = slow.io_counters(fs)
    infos = storage.list_files(fs, root)
    assert counters.snapshot() == {"requests": 1, "bytes_read": 0, "opens": 0}
    data = storage.read_many(fs, infos)
    assert [len(d) for d in data] == [10, 20, 30, 1]
    assert counters.snapshot() == {"requests": 5, "bytes_read": 61, "opens": 4}
    with fs.open_input_file(infos[2].path) as f:  # two reads at other offsets: two requests
        f.read_at(5, 10)
        f.read_at(5, 0)
    assert counters.snapshot()["requests"] == 8
    counters.reset()
    assert counters.snapshot()["bytes_read"] == 0
    assert slow.io_counters(pafs.LocalFileSystem()) is None


def test_slow_filesystem_adds_latency_and_shares_bandwidth(tmp_path):
    payload = os.urandom(100_000)
    for i in range(4):
        (tmp_path / f"{i}.bin").write_bytes(payload)
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), (0.02, 2_000_000))
    paths = [str(tmp_path / f"{i}.bin") for i in range(4)]
    start = time.perf_counter()
    out = storage.read_many(fs, paths, threads=4)
    elapsed = time.perf_counter() - start
    assert out == [payload] * 4
    # 400 KB through one 2 MB/s pipe takes 0.2 s however many threads read; lower bound only.
    assert elapsed >= 0.19


def test_slow_tier_concurrency_serializes_requests(tmp_path):
    (tmp_path / "x").write_bytes(b"x")
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), slow.SlowTier(0.02, None, 1))
    start = time.perf_counter()
    threads = [threading.Thread(target=fs.get_file_info, args=(str(tmp_path / "x"),))
               for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start >= 0.095  # five requests, one at a time


def test_slow_filesystem_pickles_and_writes(tmp_path):
    fs = slow.slow_filesystem(pafs.LocalFileSystem(), "ssd")
    again = pickle.loads(pickle.dumps(fs))
    storage.write_bytes_atomic(again, str(tmp_path / "d" / "f"), b"data")
    assert (tmp_path / "d" / "f").read_bytes() == b"data"
    assert os.listdir(tmp_path / "d") == ["f"]


def test_a_unit_whose_every_read_failed_on_the_storage_raises():
    from raying.errors import CredentialsError, StorageError
    from raying.storage.files import NotFoundError, refuse_outage

    down = StorageError("cannot reach the S3 endpoint http://x to read s3://b/k")
    refused = CredentialsError("access to s3://b/k was refused")
    with pytest.raises(StorageError, match="none of the 3 reads.*cannot reach"):
        refuse_outage([down, down, down])
    with pytest.raises(CredentialsError, match="none of the 2 reads.*refused"):
        refuse_outage([refused, down])
    # Bad input stays under the skip policy: missing files, one good read, a unit of one.
    refuse_outage([NotFoundError("gone"), down, down])
    refuse_outage([b"jpeg", down, down])
    refuse_outage([down])
    refuse_outage([])


def test_a_read_that_could_not_reach_the_storage_stops_its_unit_beside_good_reads():
    """A NameNode or endpoint that went down mid-epoch: the reads that failed on it are not
    bad files, whether the unit's other reads succeeded or it had only one."""
    from raying.errors import StorageError
    from raying.storage.errors import storage_error
    from raying.storage.files import refuse_outage

    lost = storage_error(OSError("Connection refused"), None, "b/k", uri="s3://b/k",
                         attempts=5)
    assert isinstance(lost, StorageError) and lost.outage
    io_error = storage_error(OSError("Input/output error"), None, "/d/f.jpg", uri="/d/f.jpg")
    assert isinstance(io_error, StorageError) and not io_error.outage
    missing = storage_error(FileNotFoundError("/d/f.jpg"), None, "/d/f.jpg", uri="/d/f.jpg")
    assert not missing.outage
    for datas in ([b"jpeg", lost, b"jpeg"], [lost], [io_error, lost]):
        with pytest.raises(StorageError, match=r"\d of the \d reads of this unit could not "
                                               r"reach the storage.*Connection refused") as info:
            refuse_outage(datas)
        assert info.value.outage
    refuse_outage([b"jpeg", io_error])  # a file's own I/O error stays under the policy
    refuse_outage([missing])


def test_a_symlink_loop_lists_each_file_once_and_says_so(tmp_path, caplog):
    root = tmp_path / "root"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.jpg").write_bytes(b"x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.jpg").write_bytes(b"y")
    (root / "cat" / "back").symlink_to(root)          # a loop: cat/back/cat/back/...
    (root / "dog").symlink_to(tmp_path / "elsewhere")  # a linked class folder: kept
    (tmp_path / "elsewhere" / "again").symlink_to(tmp_path / "elsewhere" / "b.jpg")  # a copy
    fs, path = storage.resolve(str(root))
    with caplog.at_level(logging.WARNING, logger="raying.storage.files"):
        infos = storage.list_files(fs, path)
    rel = [i.path[len(str(root)) + 1:] for i in infos]
    assert rel == ["cat/a.jpg", "dog/again", "dog/b.jpg"], rel
    assert "symlink loop" in caplog.text and "root/cat/back is " in caplog.text


def test_names_that_are_not_utf8_are_left_out_and_named(tmp_path, caplog):
    """A Latin-1 file name (pyarrow cannot decode its path) is set aside with a warning that
    names it; the good files beside it are listed."""
    root = tmp_path / "root"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "ok.jpg").write_bytes(b"x")
    open(os.fsencode(root / "cat") + b"/caf\xe9.jpg", "wb").close()
    fs, path = storage.resolve(str(root))
    with caplog.at_level(logging.WARNING, logger="raying.storage.files"):
        infos = storage.list_files(fs, path)
    assert [i.path[len(str(root)) + 1:] for i in infos] == ["cat/ok.jpg"]
    assert "left out 1 entries" in caplog.text and "cat/caf\\xe9.jpg" in caplog.text
    assert "not UTF-8" in caplog.text and "convmv" in caplog.text


def test_a_failed_hdfs_read_is_a_network_failure_and_retried():
    # libhdfs's words when no DataNode holding the block answered (pyarrow's OSError).
    exc = OSError(255, "HDFS read failed. Detail: [errno 255] Unknown error 255")
    assert _errors.classify(exc) == "network" and _errors.is_retryable(exc)
    # A Parquet file that does not parse is not the storage's failure.
    assert _errors.classify(ValueError("Parquet magic bytes not found in footer")) == "permanent"
    # Its error, and a write whose blocks no DataNode took, name the DataNodes.
    err = storage_error(exc, None, "nn:9000/d/x.jpg", uri="hdfs://nn:9000/d/x.jpg", probe=False)
    assert str(err).startswith("cannot read hdfs://nn:9000/d/x.jpg: ")
    assert "Check that the DataNodes holding its blocks are up" in str(err)
    assert "hdfs fsck PATH, a file's missing blocks" in str(err)
    closed = OSError(255, "HDFS CloseFile failed")
    err = storage_error(closed, None, "nn:9000/d/p.parquet", uri="hdfs://nn:9000/d/p.parquet",
                        action="write", probe=False)
    assert "(hdfs dfsadmin -report lists the live ones)" in str(err)


def test_a_java_home_with_a_symlink_loop_is_refused_at_once_not_searched_for_ever(hadoop,
                                                                                   tmp_path):
    # JAVA_HOME=/usr (what dirname $(dirname $(which java)) gives on Debian): a search of
    # every folder below it followed /usr/bin/X11 -> . for ever. A libjvm.so elsewhere below
    # is not one that libhdfs loads either.
    usr = tmp_path / "usr"
    (usr / "bin").mkdir(parents=True)
    (usr / "bin" / "X11").symlink_to(".")
    (usr / "share" / "deep" / "jdk").mkdir(parents=True)
    (usr / "share" / "deep" / "jdk" / "libjvm.so").write_bytes(b"")
    env = {**hadoop, "JAVA_HOME": str(usr)}
    with pytest.raises(DependencyError, match=r"holds no libjvm.so in lib/server.*readlink"):
        _hdfs.check_hdfs_environment(env)
    # Another CPU architecture's folder is found where it lies.
    (usr / "lib" / "ppc64le" / "server").mkdir(parents=True)
    (usr / "lib" / "ppc64le" / "server" / "libjvm.so").write_bytes(b"")
    _hdfs.check_hdfs_environment(env)


def test_a_default_fs_uri_that_fell_back_to_file_names_the_configuration_folder():
    from raying.storage.errors import storage_error

    lost = storage_error(FileNotFoundError("no such file"), None, "/data/x",
                         uri="hdfs:///data/x")
    assert "core-site.xml that libhdfs finds on CLASSPATH" in str(lost)
    odd = storage_error(OSError("Unexpected HDFS working directory URI: file:/home/a"), None,
                        "/data/x", uri="hdfs:///data/x", probe=False)
    assert "put the configuration folder (HADOOP_CONF_DIR" in str(odd)
    named = storage_error(FileNotFoundError("no such file"), None, "/data/x",
                          uri="hdfs://nn:8020/data/x")
    assert "CLASSPATH" not in str(named)


def test_a_retried_call_without_an_account_warns_once_then_succeeds(caplog, tmp_path,
                                                                   monkeypatch):
    """A scan-side call (no on_retry) says it is waiting on storage at its first retry, once,
    and the next such call within RETRY_WARNING_EVERY_S does not say it again; a read task's
    call (its retries counted by on_retry) says so at its second retry only: one blip is
    routine and counted, a read that keeps failing holds the epoch (with Hadoop's client
    defaults, minutes) and must not do so in silence."""
    monkeypatch.setattr(_errors, "_last_retry_warning", [-1e9])
    fails = [ConnectionResetError("connection reset by peer")] * 2

    def call():
        if fails:
            raise fails.pop()
        return "ok"

    fs = pafs.LocalFileSystem()
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        assert _errors.retrying(call, fs, str(tmp_path / "x"), 4, 0.001) == "ok"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "attempt 2 of 4" in warned[0].getMessage()
    assert "connection reset" in warned[0].getMessage()
    caplog.clear()
    fails[:] = [ConnectionResetError("connection reset by peer")]
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        assert _errors.retrying(call, fs, str(tmp_path / "x"), 4, 0.001) == "ok"
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # within the interval
    caplog.clear()
    fails[:] = [ConnectionResetError("connection reset by peer")] * 2
    counted = []
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        assert _errors.retrying(call, fs, str(tmp_path / "x"), 4, 0.001,
                                on_retry=lambda *a: counted.append(a)) == "ok"
    assert len(counted) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the interval's
    monkeypatch.setattr(_errors, "_last_retry_warning", [-1e9])
    caplog.clear()
    fails[:] = [ConnectionResetError("connection reset by peer")]
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        assert _errors.retrying(call, fs, str(tmp_path / "x"), 4, 0.001,
                                on_retry=lambda *a: counted.append(a)) == "ok"
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # one blip: counted only
    caplog.clear()
    fails[:] = [ConnectionResetError("connection reset by peer")] * 2
    with caplog.at_level(logging.DEBUG, logger="raying.storage.files"):
        assert _errors.retrying(call, fs, str(tmp_path / "x"), 4, 0.001,
                                on_retry=lambda *a: counted.append(a)) == "ok"
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.WARNING]
    assert "attempt 3 of 4" in caplog.records[1].getMessage()


def test_options_for_workers_carry_the_environment_s_endpoint_and_region_not_its_keys(
        monkeypatch):
    from raying.options import StorageOptions
    from raying.storage.spec import travelling_options

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    got = travelling_options("s3://bucket/train", None)
    assert (got.endpoint_url, got.region) == ("http://127.0.0.1:9000", "eu-west-3")
    assert got.access_key_id is None and got.secret_access_key is None  # workers' own chain
    assert "env-secret" not in repr(got) and "env-secret" not in str(pickle.dumps(got))
    # What the user gave wins over the environment, and the rest of it is kept.
    given = {"endpoint_url": "http://10.0.0.1:9000", "anonymous": True, "slow": "hdd"}
    got = travelling_options("s3a://bucket/train", given)
    assert got.endpoint_url == "http://10.0.0.1:9000" and got.region == "eu-west-3"
    assert got.anonymous and got.slow == "hdd"
    # Local and HDFS options travel as they are.
    for uri in ("/data/train", "hdfs://nn:8020/train"):
        opts = StorageOptions(slow="hdd", hdfs_user="alice")
        assert travelling_options(uri, opts) == opts


def test_a_path_that_can_never_open_is_said_at_once_not_retried(tmp_path):
    """A loop of symbolic links or a name over the file system's limit fails the same way at
    every attempt: reported at the first, with the file, not after the retries' backoff."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    fs, root = storage.resolve(str(tmp_path))
    for path in (f"{root}/a", f"{root}/{'x' * 300}.jpg"):
        retries: list = []
        with pytest.raises(StorageError, match=re.escape(path)):
            storage.read_bytes(fs, path, on_retry=lambda *a, seen=retries: seen.append(a),
                               backoff=0.5)
        assert retries == [], path


def test_a_filesystem_let_go_leaves_its_spec_to_no_other_object():
    """Specs were kept by a filesystem's id: once an S3 filesystem was let go (the cache
    cleared), a local filesystem born at the same id spoke of S3 in its errors."""
    import gc

    s3ish = pafs.LocalFileSystem()  # stands for a filesystem that StorageSpec built
    _errors.register(s3ish, StorageSpec("s3", options=None))
    freed = id(s3ish)
    del s3ish
    gc.collect()
    born = [pafs.LocalFileSystem() for _ in range(2000)]
    reused = next((fs for fs in born if id(fs) == freed), None)
    if reused is None:  # the allocator put none there: the entry must still not leak out
        _errors._SPECS[id(born[0])] = _errors._SPECS.pop(freed)
        reused = born[0]
    assert _errors._spec_of(reused) is None
    err = storage_error(PermissionError(13, "Permission denied"), reused, "/x")
    assert str(err) == "permission denied to read /x; check the file's owner and mode"


@pytest.mark.parametrize("told", [0, 5, 4095, 4096, 4097, 3 << 20])
def test_local_read_gets_the_whole_file_whatever_fstat_said(tmp_path, monkeypatch, told):
    """A local file is read in one call of the size fstat gave; one that grew or shrank
    since (fstat's size is stale) still comes back whole, to its end."""
    data = bytes(range(256)) * 9000 + b"tail"  # 2.3 MB: more than one read-on step
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    real = os.fstat

    def stale(fd):
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid,
                               st.st_gid, told, st.st_atime, st.st_mtime, st.st_ctime))

    fs, root = storage.resolve(str(tmp_path))
    monkeypatch.setattr(storage.os, "fstat", stale)
    assert storage.read_bytes(fs, f"{root}/a.jpg") == data


def test_local_read_of_empty_and_exact_files(tmp_path):
    fs, root = storage.resolve(str(tmp_path))
    for n in (0, 1, 4096, (1 << 20) + 3):
        (tmp_path / f"{n}.jpg").write_bytes(b"x" * n)
        assert storage.read_bytes(fs, f"{root}/{n}.jpg") == b"x" * n
