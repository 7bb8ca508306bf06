"""Fixtures shared by every test folder: the live S3 endpoint (see tests/s3server.py) and the live
HDFS (see tests/hdfscluster.py)."""

from tests.hdfscluster import hdfs, hdfs_cluster  # noqa: F401 - fixtures, registered by import
from tests.s3server import s3_endpoint, s3_server  # noqa: F401 - fixtures, registered by import
