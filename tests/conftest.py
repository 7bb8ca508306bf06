"""Fixtures shared by every test folder: the live S3 endpoint (see tests/s3server.py)."""

from tests.s3server import s3_endpoint, s3_server  # noqa: F401 - fixtures, registered by import
