"""A live S3 endpoint for tests: a moto server in a child process on 127.0.0.1, and fixtures.

Fixtures (registered in tests/conftest.py):
    s3_server    session-scoped S3Server, started once, stopped at the end of the session.
    s3_endpoint  session-scoped endpoint URL (``http://127.0.0.1:PORT``); while it lives (from the
                 first test that asks for it to the end of the session) the environment holds
                 dummy AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION, which moto
                 accepts, and AWS_EC2_METADATA_DISABLED=true; Ray workers started afterwards
                 inherit them. AWS_ENDPOINT_URL is not set: pass the endpoint explicitly.

Use ``start_s3_server()`` for a server of a test's own (faults, authentication).

Restarts. ``stop()`` kills the child; moto keeps its objects in memory, so a new process starts
empty. With ``stop(keep_data=True)`` (the default) the helper first downloads every bucket and
object into its state folder, and the next ``start()`` loads them into moto *before* the port
accepts connections: a restart then behaves like a real S3 restart (an outage, nothing lost,
no race between readers and a re-upload). With ``keep_data=False`` the server comes back
empty; call ``upload_folder`` again to re-upload. An ``auth=True`` server gets new credentials
at every start (``server.credentials``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HOST = "127.0.0.1"
REGION = "us-east-1"
DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "raying-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "raying-test-secret-key",
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}
DEFAULT_START_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class S3Server:
    """A moto S3 server in a child process (see the module docstring for restart semantics).

    Args:
        port: the port to listen on; a free one when None. It stays the same across restarts.
        auth: enforce credentials: only ``server.credentials`` (an IAM user's keys) are
            accepted, anything else gets AccessDenied / InvalidAccessKeyId.
        state_dir: where snapshots and the child's log go; a temp folder when None.
    """

    def __init__(self, *, port: int | None = None, auth: bool = False,
                 state_dir: str | os.PathLike | None = None) -> None:
        self.port = port or free_port()
        self.auth = auth
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="raying-s3-"))
        self.endpoint = f"http://{HOST}:{self.port}"
        self.credentials = {"access_key_id": DUMMY_ENV["AWS_ACCESS_KEY_ID"],
                            "secret_access_key": DUMMY_ENV["AWS_SECRET_ACCESS_KEY"]}
        self._proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict[str, str]:
        """``storage=`` for raying: this endpoint and credentials it accepts."""
        return {"endpoint_url": self.endpoint, **self.credentials}

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start the child; return once it accepts connections with the saved state loaded."""
        if self.running:
            return
        cmd = [sys.executable, os.path.abspath(__file__), "--port", str(self.port),
               "--state", str(self.state_dir)] + (["--auth"] if self.auth else [])
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.state_dir / "server.log", "ab")  # noqa: SIM115 - owned by the child
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                      env={**os.environ, **DUMMY_ENV})
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.2)
            if ready:
                line = self._proc.stdout.readline()
                if line:
                    info = json.loads(line)
                    if self.auth:
                        self.credentials = info["credentials"]
                    return
        self.stop(keep_data=True, snapshot=False)
        msg = f"moto server did not start on port {self.port}; see {self.state_dir}/server.log"
        raise RuntimeError(msg)

    def stop(self, *, keep_data: bool = True, snapshot: bool = True) -> None:
        """Stop the child. ``keep_data``: snapshot everything so the next start() has it."""
        if self.running and keep_data and snapshot:
            self.snapshot()
        if not keep_data:
            shutil.rmtree(self.state_dir / "objects", ignore_errors=True)
            (self.state_dir / "state.json").unlink(missing_ok=True)
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc.stdout.close()
            self._proc = None

    def restart(self, *, down_s: float = 0.0, keep_data: bool = True,
                snapshot: bool = True) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port. ``snapshot=False``
        stops at once, keeping the state of the last ``snapshot()`` (which reads every
        object back through the server first: seconds while the server still answers)."""
        self.stop(keep_data=keep_data, snapshot=snapshot)
        time.sleep(down_s)
        self.start()

    def client(self):
        """A boto3 S3 client for this server (with its valid credentials)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.credentials["access_key_id"],
                            aws_secret_access_key=self.credentials["secret_access_key"])

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)

    def upload_folder(self, local_dir: str | os.PathLike, bucket: str, prefix: str = "") -> str:
        """Upload every file under ``local_dir`` (hidden ones too) to ``bucket/prefix``.

        Returns:
            The ``s3://bucket/prefix`` URI of the uploaded folder.
        """
        self.create_bucket(bucket)
        client = self.client()
        root = Path(local_dir)
        prefix = prefix.strip("/")
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix, path.relative_to(root).as_posix()]))
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        return f"s3://{bucket}/{prefix}".rstrip("/")

    def snapshot(self) -> None:
        """Save every bucket and object into the state folder (loaded by the next start)."""
        client = self.client()
        objects_dir = self.state_dir / "objects"
        shutil.rmtree(objects_dir, ignore_errors=True)
        objects_dir.mkdir(parents=True)
        state: dict = {"buckets": [], "objects": []}
        for bucket in client.list_buckets().get("Buckets", []):
            name = bucket["Name"]
            state["buckets"].append(name)
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                for obj in page.get("Contents", []):
                    blob = objects_dir / str(len(state["objects"]))
                    body = client.get_object(Bucket=name, Key=obj["Key"])["Body"].read()
                    blob.write_bytes(body)
                    state["objects"].append([name, obj["Key"], blob.name])
        (self.state_dir / "state.json").write_text(json.dumps(state))


@contextlib.contextmanager
def start_s3_server(**kwargs):
    """A server of one test's own: ``with start_s3_server(auth=True) as server: ...``."""
    server = S3Server(**kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop(keep_data=False)
        shutil.rmtree(server.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's moto S3 server (an S3Server)."""
    server = S3Server(state_dir=tmp_path_factory.mktemp("s3server"))
    server.start()
    yield server
    server.stop(keep_data=False)


@pytest.fixture(scope="session")
def s3_endpoint(s3_server):
    """The session server's endpoint URL, with dummy AWS credentials in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in DUMMY_ENV.items():
            mp.setenv(name, value)
        yield s3_server.endpoint


# --- the child process ----------------------------------------------------------------------


def _serve(port: int, state_dir: Path, auth: bool) -> None:
    import logging

    from moto import mock_aws, settings
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # Load the saved state through moto's in-process mock (same backends the server serves)
    # before the port is bound, so no client ever sees a half-loaded server.
    mock = mock_aws()
    mock.start()
    import boto3

    client = boto3.client("s3", region_name=REGION)
    state_file = state_dir / "state.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        for bucket in state["buckets"]:
            client.create_bucket(Bucket=bucket)
        for bucket, key, blob in state["objects"]:
            body = (state_dir / "objects" / blob).read_bytes()
            client.put_object(Bucket=bucket, Key=key, Body=body)
    credentials = None
    if auth:
        iam = boto3.client("iam", region_name=REGION)
        iam.create_user(UserName="raying-test")
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="raying-test", PolicyName="all",
                            PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="raying-test")["AccessKey"]
        credentials = {"access_key_id": key["AccessKeyId"],
                       "secret_access_key": key["SecretAccessKey"]}
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on every request is checked
    app = DomainDispatcherApplication(create_backend_app)
    deadline = time.monotonic() + 10
    while True:  # the previous process may still hold the port for a moment
        try:
            server = make_server(HOST, port, app, threaded=True,
                                 request_handler=MotoRequestHandler)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print(json.dumps({"ready": True, "credentials": credentials}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--auth", action="store_true")
    args = parser.parse_args()
    _serve(args.port, args.state, args.auth)
