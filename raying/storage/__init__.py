"""Storage: URIs and the filesystems behind them (local, S3, HDFS), with retries, clear errors
and a storage-tier profile for planning. Imports only ``errors`` and ``options``."""
