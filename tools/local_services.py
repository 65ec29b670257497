"""Real services on 127.0.0.1 for the tests and benchmarks: a free port, and moto's S3-compatible server
(`moto[server]`, in the dev extra) reached over HTTP by the same boto3 code a user runs against AWS or MinIO.

    with s3_server(bucket="datasets") as env:   # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for that server
        ...
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def s3_server(bucket: str, authenticated: bool = True) -> Iterator[dict[str, str]]:
    """moto's server on a free port with `bucket` created; yields the standard AWS_* variables a client needs (not set
    here). `authenticated`: requests need the keys of an IAM user created first, as on AWS (else moto takes any key).
    The server is stopped on exit."""
    import boto3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # With authentication on, the first 3 requests need no credentials: creating the user, its keys, its policy.
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "3"} if authenticated else {})},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                break
            time.sleep(0.1)
        keys = {"AccessKeyId": "local", "SecretAccessKey": "local"}
        if authenticated:
            iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="a",
                               aws_secret_access_key="b")
            iam.create_user(UserName="trainer")
            keys = iam.create_access_key(UserName="trainer")["AccessKey"]
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": keys["AccessKeyId"], "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_SECRET_ACCESS_KEY": keys["SecretAccessKey"]}
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=bucket)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)
