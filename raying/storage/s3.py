"""S3 settings from StorageOptions and the standard AWS environment, and the hint for refusals."""

from __future__ import annotations

import dataclasses
import os
import threading
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raying.errors import ConfigError, CredentialsError, DependencyError
from raying.options import StorageOptions

# pyarrow asks the network for a bucket's region when none is given; an S3-compatible server
# (MinIO, moto, Ceph) has no such lookup, and us-east-1 is what those servers expect.
DEFAULT_S3_REGION_WITH_ENDPOINT = "us-east-1"

FIX_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, or "
    "pass storage={'profile': ...} or storage={'access_key_id': ..., 'secret_access_key': ...}; "
    "for a public bucket pass storage={'anonymous': True}"
)

# Secrets seen in this process (explicit options, profiles resolved through botocore); error
# text is scrubbed of them, and of the secrets in the environment, before it is raised or logged.
_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
# Shorter values are not real secrets (and would mangle paths that happen to contain them);
# access key ids are scrubbed too when they look like AWS's (20 characters).
_MIN_SECRET_CHARS = 8
_MIN_KEY_ID_CHARS = 16
_REGION_BY_BUCKET: dict[str, str | None] = {}


def remember_secrets(key_id: str | None, *secrets: str | None) -> None:
    """Record credentials so that :func:`scrub` removes them from any text."""
    with _SECRETS_LOCK:
        _SECRETS.update(_worth_scrubbing(key_id, *secrets))


def _worth_scrubbing(key_id: str | None, *secrets: str | None) -> set[str]:
    out = {v for v in secrets if v and len(v) >= _MIN_SECRET_CHARS}
    if key_id and len(key_id) >= _MIN_KEY_ID_CHARS:
        out.add(key_id)
    return out


def scrub(text: str) -> str:
    """Return ``text`` with every known secret replaced by ``***``."""
    env = os.environ.get
    with _SECRETS_LOCK:
        secrets = set(_SECRETS)
    secrets |= _worth_scrubbing(env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"),
                                env("AWS_SESSION_TOKEN"))
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def split_endpoint(url: str) -> tuple[str, str]:
    """Split ``http(s)://host:port`` into pyarrow's ``scheme`` and ``endpoint_override``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        msg = (f"endpoint_url must look like http://host:port or https://host, got {url!r}; "
               "fix storage={'endpoint_url': ...} or AWS_ENDPOINT_URL")
        raise ConfigError(msg)
    return parts.scheme, parts.netloc + parts.path.rstrip("/")


def effective_options(options: StorageOptions, bucket: str) -> StorageOptions:
    """Fill the endpoint and region from the environment: what a Ray worker must reuse.

    Credentials are left out on purpose: workers find their own through their credentials chain.
    """
    endpoint = (options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)
    if endpoint:
        split_endpoint(endpoint)
    if options.access_key_id and not options.secret_access_key:
        msg = "storage option access_key_id is set but secret_access_key is not; pass both"
        raise ConfigError(msg)
    if options.secret_access_key and not options.access_key_id:
        msg = "storage option secret_access_key is set but access_key_id is not; pass both"
        raise ConfigError(msg)
    if options.anonymous and (options.access_key_id or options.profile):
        msg = "storage option anonymous=True cannot be combined with keys or a profile"
        raise ConfigError(msg)
    region = (options.region or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION") or None)
    if region is None and endpoint:
        region = DEFAULT_S3_REGION_WITH_ENDPOINT
    if region is None and not options.profile:
        region = _bucket_region(bucket)
    return dataclasses.replace(options, endpoint_url=endpoint, region=region)


def _bucket_region(bucket: str) -> str | None:
    # One lookup per bucket and process; offline (or for a missing bucket) the SDK decides.
    if bucket not in _REGION_BY_BUCKET:
        try:
            _REGION_BY_BUCKET[bucket] = pafs.resolve_s3_region(bucket)
        except OSError:
            _REGION_BY_BUCKET[bucket] = None
    return _REGION_BY_BUCKET[bucket]


def s3_filesystem(options: StorageOptions, *, attempts: int) -> pafs.S3FileSystem:
    """Build the pyarrow S3FileSystem for options already passed through effective_options."""
    # The SDK's "default" strategy backs off for milliseconds (5 attempts on a refused connection:
    # 0.75 s measured, against 7.3 s for its "standard" one); the long, logged backoff across an
    # outage is storage._retrying's, on top of this one.
    kwargs: dict = {"retry_strategy": pafs.AwsDefaultS3RetryStrategy(max_attempts=attempts)}
    if options.endpoint_url:
        kwargs["scheme"], kwargs["endpoint_override"] = split_endpoint(options.endpoint_url)
    region = options.region
    if options.anonymous:
        kwargs["anonymous"] = True
    elif options.access_key_id:
        remember_secrets(options.access_key_id, options.secret_access_key, options.session_token)
        kwargs.update(access_key=options.access_key_id, secret_key=options.secret_access_key,
                      session_token=options.session_token)
    elif options.profile:
        keys, profile_region = profile_credentials(options.profile)
        kwargs.update(keys)
        region = region or profile_region
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def profile_credentials(profile: str) -> tuple[dict, str | None]:
    """Resolve a profile of the shared AWS config files through botocore.

    Returns:
        The pyarrow keyword arguments holding the keys, and the profile's region (or None).
    """
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        msg = (f"storage option profile={profile!r} needs botocore to read the AWS config "
               "files; install it with: pip install boto3 (or export AWS_PROFILE instead, "
               "which pyarrow reads itself)")
        raise DependencyError(msg) from None
    try:
        session = botocore.session.Session(profile=profile)
        creds = session.get_credentials()
        region = session.get_config_variable("region")
    except botocore.exceptions.ProfileNotFound:
        msg = (f"AWS profile {profile!r} is not in the AWS config files (~/.aws/config, "
               "~/.aws/credentials, or AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE); "
               "add it or fix storage={'profile': ...}")
        raise ConfigError(msg) from None
    except botocore.exceptions.BotoCoreError as exc:
        msg = f"AWS profile {profile!r} could not give credentials: {scrub(str(exc))}"
        raise CredentialsError(msg) from None
    if creds is None:
        msg = f"AWS profile {profile!r} holds no credentials; {FIX_CREDENTIALS}"
        raise CredentialsError(msg)
    frozen = creds.get_frozen_credentials()
    remember_secrets(frozen.access_key, frozen.secret_key, frozen.token)
    keys = {"access_key": frozen.access_key, "secret_key": frozen.secret_key,
            "session_token": frozen.token}
    return keys, region


def credentials_source(options: StorageOptions | None) -> str:
    """Say, without any secret and without network, which credentials a request would use."""
    if options is not None and options.anonymous:
        return "the request was anonymous (storage={'anonymous': True})"
    if options is not None and options.access_key_id:
        return "the keys passed in storage= were refused"
    if options is not None and options.profile:
        return f"the credentials of AWS profile {options.profile!r} were refused"
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "the keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY were refused"
    if os.environ.get("AWS_PROFILE"):
        return f"the credentials of AWS_PROFILE={os.environ['AWS_PROFILE']!r} were refused"
    files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
             os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")]
    if any(os.path.isfile(os.path.expanduser(f)) for f in files):
        return "the credentials from the shared AWS config files were refused"
    if any(os.environ.get(v) for v in ("AWS_WEB_IDENTITY_TOKEN_FILE",
                                       "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                       "AWS_CONTAINER_CREDENTIALS_FULL_URI")):
        return "the credentials of the web-identity or container role were refused"
    return "no AWS credentials were found in the environment or the shared config files"
