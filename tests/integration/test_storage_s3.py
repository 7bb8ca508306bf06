"""raying.storage.files against a live S3 endpoint (a moto server on 127.0.0.1 over HTTP); the same
against a live HDFS is in test_hdfs.py."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid

import pytest

from raying.errors import CredentialsError, StorageError
from raying.storage import files as storage
from raying.storage.files import NotFoundError, StorageSpec
from raying.storage.slow import io_counters
from tests.s3server import free_port, start_s3_server

CANARY = "CANARY-secret-0a9b8c7d6e5f4a3b2c1d"
BUCKET = "raying-storage"


@pytest.fixture(autouse=True)
def _fresh_filesystems(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    storage.clear_cache()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small folder: two classes of files of varied sizes, plus hidden things."""
    root = tmp_path_factory.mktemp("dataset")
    for i in range(12):
        cls = root / ("cats" if i % 2 else "dogs")
        cls.mkdir(exist_ok=True)
        (cls / f"{i:03d}.jpg").write_bytes(os.urandom(1000 + 997 * i))
    (root / "dogs" / "readme.txt").write_bytes(b"not an image")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.jpg").write_bytes(b"hidden")
    (root / "_SUCCESS").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def dataset_uri(s3_server, s3_endpoint, dataset):
    return s3_server.upload_folder(dataset, BUCKET, "sets/small")


def _relative(infos, root):
    return [(i.path[len(root) + 1:], i.size) for i in infos]


def test_list_and_read_with_the_endpoint_in_options(dataset_uri, s3_endpoint, dataset):
    fs, path = storage.resolve(dataset_uri, {"endpoint_url": s3_endpoint})
    assert path == f"{BUCKET}/sets/small"
    infos = storage.list_files(fs, path, extensions=[".jpg"])
    local_fs, local_root = storage.resolve(str(dataset))
    local = storage.list_files(local_fs, local_root, extensions=[".jpg"])
    assert _relative(infos, path) == _relative(local, local_root)
    assert len(infos) == 12
    assert storage.read_many(fs, infos) == storage.read_many(local_fs, local)
    [one] = storage.list_files(fs, f"{path}/dogs/readme.txt")  # a key lists as itself
    assert one.size == len(b"not an image")
    with pytest.raises(NotFoundError, match=rf"s3://{BUCKET}/sets/nothing does not exist"):
        storage.list_files(fs, f"{BUCKET}/sets/nothing")


def test_endpoint_from_the_environment(dataset_uri, s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    fs, path = storage.resolve(dataset_uri)
    assert len(storage.list_files(fs, path)) == 13
    # The S3-specific variable wins over the generic one.
    storage.clear_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    fs, path = storage.resolve(dataset_uri)
    assert storage.read_bytes(fs, f"{path}/dogs/readme.txt") == b"not an image"


def test_a_spec_rebuilds_the_filesystem_in_another_process(dataset_uri, s3_endpoint,
                                                          monkeypatch):
    """What a Ray worker does: the endpoint travels in the spec, credentials come from its env."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    spec, path = StorageSpec.from_uri(dataset_uri)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    code = ("import pickle, sys\nfrom raying.storage import files as storage\n"
            "spec, path = pickle.loads(sys.stdin.buffer.read())\n"
            "print(storage.read_bytes(spec.filesystem(), path + '/dogs/readme.txt').decode())")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((spec, path)),
                         capture_output=True, check=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.decode().strip() == "not an image"


def test_write_atomic_exists_and_missing(dataset_uri, s3_endpoint):
    fs, path = storage.resolve(dataset_uri, {"endpoint_url": s3_endpoint})
    target = f"{BUCKET}/written/{uuid.uuid4().hex}/manifest.parquet"
    assert not storage.exists(fs, target)
    storage.write_bytes_atomic(fs, target, b"payload")
    assert storage.exists(fs, target)
    assert storage.read_bytes(fs, target) == b"payload"
    with pytest.raises(NotFoundError, match=rf"^s3://{BUCKET}/sets/small/nope.jpg does not "
                                            r"exist; check the key or prefix \(the bucket "
                                            r"exists\)$"):
        storage.read_bytes(fs, f"{path}/nope.jpg")
    with pytest.raises(NotFoundError, match=r"s3://no-such-bucket/x does not exist: bucket "
                                            r"'no-such-bucket' does not exist at http://127"):
        storage.list_files(fs, "no-such-bucket/x")
    with pytest.raises(NotFoundError, match="bucket 'no-such-bucket' does not exist"):
        storage.read_bytes(fs, "no-such-bucket/x")


def test_unreachable_endpoint_names_it(s3_endpoint):
    dead = f"http://127.0.0.1:{free_port()}"
    fs, path = storage.resolve(f"s3://{BUCKET}/x.jpg", {"endpoint_url": dead})
    start = time.monotonic()
    with pytest.raises(StorageError, match=rf"cannot reach the S3 endpoint {dead} to read "
                                           rf"s3://{BUCKET}/x.jpg \(after 2 attempts\).*"
                                           "Check that the server is up"):
        storage.read_bytes(fs, path, retries=2, backoff=0.01)
    assert time.monotonic() - start < 30


def test_slow_tier_over_s3_counts_requests(dataset_uri, s3_endpoint):
    fs, path = storage.resolve(dataset_uri, {"endpoint_url": s3_endpoint, "slow": (0.001, None)})
    infos = storage.list_files(fs, path, extensions=".jpg")
    data = storage.read_many(fs, infos, threads=4)
    counters = io_counters(fs).snapshot()
    assert counters["bytes_read"] == sum(len(d) for d in data) == sum(i.size for i in infos)
    assert counters["opens"] == 12 and counters["requests"] == 13


# --- credentials ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(dataset):
    """A server that checks credentials (only its IAM user's keys are accepted)."""
    with start_s3_server(auth=True) as server:
        server.upload_folder(dataset, BUCKET)
        yield server


@pytest.fixture
def no_shared_config(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_valid_credentials_read(auth_server):
    fs, path = storage.resolve(f"s3://{BUCKET}/dogs/readme.txt", auth_server.storage_options)
    assert storage.read_bytes(fs, path) == b"not an image"


def test_wrong_secret_is_refused_and_never_shown(auth_server, caplog, capfd):
    options = {"endpoint_url": auth_server.endpoint,
               "access_key_id": auth_server.credentials["access_key_id"],
               "secret_access_key": CANARY}
    spec, path = StorageSpec.from_uri(f"s3://{BUCKET}", options)
    fs = spec.filesystem()
    errors = []
    with caplog.at_level(logging.DEBUG):
        for call in (lambda: storage.list_files(fs, path),
                     lambda: storage.read_bytes(fs, f"{path}/dogs/readme.txt"),
                     lambda: storage.read_many(fs, [f"{path}/dogs/readme.txt"])[0]):
            try:
                result = call()
            except CredentialsError as exc:
                result = exc
            assert isinstance(result, CredentialsError)
            errors.append(result)
    assert "the keys passed in storage= were refused" in str(errors[0])
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)" in str(errors[0])
    captured = capfd.readouterr()
    texts = [str(e) for e in errors] + [repr(e) for e in errors] + [
        repr(spec), str(spec), repr(spec.options), caplog.text, captured.out, captured.err]
    for text in texts:
        assert CANARY not in text


def test_wrong_environment_credentials(auth_server, monkeypatch, no_shared_config, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CANARY)
    fs, path = storage.resolve(f"s3://{BUCKET}", {"endpoint_url": auth_server.endpoint})
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(CredentialsError, match=r"^access to s3://raying-storage was refused: "
                                                   "the keys in AWS_ACCESS_KEY_ID / "
                                                   "AWS_SECRET_ACCESS_KEY were refused") as info:
            storage.list_files(fs, path)
    assert CANARY not in str(info.value) + caplog.text


def test_no_credentials_at_all(auth_server, monkeypatch, no_shared_config):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    fs, path = storage.resolve(f"s3://{BUCKET}/dogs/readme.txt",
                               {"endpoint_url": auth_server.endpoint})
    with pytest.raises(CredentialsError, match="no AWS credentials were found in the "
                                               "environment or the shared config files"):
        storage.read_bytes(fs, path)
    fs, path = storage.resolve(f"s3://{BUCKET}/dogs/readme.txt",
                               {"endpoint_url": auth_server.endpoint, "anonymous": True})
    with pytest.raises(CredentialsError, match=r"the request was anonymous \(storage="):
        storage.read_bytes(fs, path)


def test_a_manifest_loaded_with_keys_keeps_them_and_names_refusals(auth_server):
    # load(storage=...) kept only the settings without secrets: the loaded manifest's reads
    # went out with the environment's keys. Refused keys and a missing manifest were a
    # DataError "scan the dataset again".
    import raying
    from raying.errors import DataError

    good = auth_server.storage_options
    m = raying.Manifest.scan(f"s3://{BUCKET}", storage=good)
    m.save(f"s3://{BUCKET}/saved/m.manifest")
    loaded = raying.Manifest.load(f"s3://{BUCKET}/saved/m.manifest", storage=good)
    assert len(loaded) == len(m) == 12
    assert loaded.storage.secret_access_key == good["secret_access_key"]
    fs, root = storage.resolve(loaded.root, loaded.storage)
    first = f"{root}/{loaded.path_of(0)[0]}"
    assert len(storage.read_bytes(fs, first)) == int(loaded.sizes[0])
    # What the file holds never carries a secret.
    raw = storage.read_bytes(*storage.resolve(f"s3://{BUCKET}/saved/m.manifest", good))
    assert good["secret_access_key"].encode() not in raw
    bad = {**good, "secret_access_key": CANARY}
    with pytest.raises(CredentialsError, match="the keys passed in storage= were refused") as e:
        raying.Manifest.load(f"s3://{BUCKET}/saved/m.manifest", storage=bad)
    assert CANARY not in str(e.value)
    with pytest.raises(NotFoundError, match=r"no manifest at s3://raying-storage/saved/x"):
        raying.Manifest.load(f"s3://{BUCKET}/saved/x.manifest", storage=good)
    storage.write_bytes_atomic(*storage.resolve(f"s3://{BUCKET}/saved/bad.manifest", good), b"junk")
    with pytest.raises(DataError, match="is not a readable manifest"):
        raying.Manifest.load(f"s3://{BUCKET}/saved/bad.manifest", storage=good)


def test_a_manifest_scanned_unsigned_loads_with_keys(dataset_uri, s3_endpoint):
    import raying

    m = raying.Manifest.scan(dataset_uri, storage={"endpoint_url": s3_endpoint,
                                                   "anonymous": True})
    uri = f"s3://{BUCKET}/saved/anon-{uuid.uuid4().hex}.manifest"
    m.save(uri, storage={"endpoint_url": s3_endpoint})  # moto keeps unsigned PUTs' chunking
    keys = {"endpoint_url": s3_endpoint, "access_key_id": "AKIAEXAMPLE000000000",
            "secret_access_key": "x" * 40}
    loaded = raying.Manifest.load(uri, storage=keys)
    assert not loaded.storage.anonymous and loaded.storage.access_key_id == keys[
        "access_key_id"]
    again = raying.Manifest.load(uri, storage={"endpoint_url": s3_endpoint})
    assert again.storage.anonymous  # what the file says, where the caller says nothing else


# --- faults ---------------------------------------------------------------------------------


@pytest.mark.faults
def test_server_restarted_mid_read_loses_nothing(tmp_path):
    """Reads in flight when the server goes down are retried and all complete once it is up."""
    payloads = {f"{i:03d}.bin": os.urandom(2000 + 37 * i) for i in range(48)}
    for name, data in payloads.items():
        (tmp_path / name).write_bytes(data)
    with start_s3_server() as server:
        uri = server.upload_folder(tmp_path, BUCKET, "fault")
        options = {"endpoint_url": server.endpoint, **server.credentials,
                   "slow": (0.02, None)}  # stretches the reads across the outage
        fs, path = storage.resolve(uri, options)
        infos = storage.list_files(fs, path)
        server.snapshot()  # the data survives the restart, as on a real S3
        retried, result = [], {}

        def read_all():
            result["out"] = storage.read_many(fs, infos, threads=4, retries=10, backoff=0.1,
                                              on_retry=lambda *a: retried.append(a))

        reader = threading.Thread(target=read_all)
        reader.start()
        time.sleep(0.1)
        server.stop(snapshot=False)  # a crash: reads now fail
        time.sleep(0.5)  # with the restart, longer than the SDK's own retries (0.75 s) last
        server.start()
        reader.join(timeout=120)
        assert not reader.is_alive()
    out = result["out"]
    assert [type(o) for o in out if not isinstance(o, bytes)] == []
    assert dict(zip([i.path.rsplit("/", 1)[1] for i in infos], out, strict=True)) == payloads
    assert len(retried) > 0  # the outage was hit, and survived


def test_a_scan_of_a_missing_bucket_or_prefix_says_which(dataset_uri, s3_endpoint):
    import raying

    opts = {"endpoint_url": s3_endpoint}
    with pytest.raises(NotFoundError, match=r"^s3://no-such-bucket/train does not exist: bucket "
                                            rf"'no-such-bucket' does not exist at {s3_endpoint}; "
                                            r"check the bucket name and the endpoint$"):
        raying.Manifest.scan("s3://no-such-bucket/train", storage=opts)
    with pytest.raises(NotFoundError, match=rf"^s3://{BUCKET}/no-such-prefix does not exist; "
                                            r"check the key or prefix \(the bucket exists\)$"):
        raying.Manifest.scan(f"s3://{BUCKET}/no-such-prefix", storage=opts)
