"""Object stores (S3 and S3-compatible: MinIO, a local server): the client, URLs, keys and passing failures, for
shards (data/) and run dirs (run/) alike. Endpoint and keys come from the AWS_* variables, never from a config.

    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python -m classifier_engine fit ... --trainer.default_root_dir s3://b/runs
"""

import re
from typing import Optional

from classifier_engine.errors import ConfigError, install_extra

BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's (and MinIO's) rule for bucket names
READ_TIMEOUT_S = 15.0  # a transfer that sends nothing for this long has stalled


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without a trailing slash) of s3://bucket/prefix."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def plain_key(name: str) -> bool:
    """Whether a key relative to a prefix names a file under it: plain parts only (no .., no empty part, no \\)."""
    return "\\" not in name and all(part not in ("", ".", "..") for part in name.split("/"))


def s3_client(retries: int = 3):
    """An S3 client configured as the AWS tools are, by boto3 from the AWS_* variables (AWS_ENDPOINT_URL...) only."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError(f"s3:// shards and run dirs need boto3: {install_extra('shards')}") from None
    config = Config(connect_timeout=5, read_timeout=READ_TIMEOUT_S, retries={"max_attempts": retries})
    return boto3.session.Session().client("s3", config=config)  # a new session reads the variables again


def passing_failure(error: Exception) -> Optional[str]:
    """What went wrong, for a failure a later try may not meet (a stall, a cut transfer, no connection, a 5xx)."""
    import botocore.exceptions as be  # (its StreamingBody raises these for urllib3's errors mid-transfer)

    if isinstance(error, be.ReadTimeoutError):
        return f"the object store stopped answering (no byte for {READ_TIMEOUT_S:g} s)"
    if isinstance(error, (be.ResponseStreamingError, be.IncompleteReadError, be.ConnectionClosedError)):
        return "the object store cut the connection mid-transfer"
    if isinstance(error, (be.ConnectionError, be.HTTPClientError)):
        return "cannot reach the object store (the endpoint in AWS_ENDPOINT_URL, or AWS's when unset)"
    answer = error.response if isinstance(error, be.ClientError) else {}
    status, code = answer.get("ResponseMetadata", {}).get("HTTPStatusCode", 0), answer.get("Error", {}).get("Code", "")
    if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
        return f"the object store kept failing ({status} {code})"
    return None
