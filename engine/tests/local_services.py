"""Real services on 127.0.0.1 for the tests and benchmarks: a free port, moto's S3-compatible server (`moto[server]`,
in the dev extra) reached over HTTP by the same boto3 code a user runs against AWS or MinIO, and a proxy that makes any
such server misbehave (errors, cut connections, stalls).

    with s3_server(bucket="datasets") as env:   # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for that server
        ...
"""

import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

TOGETHER_S = 120.0  # the longest FaultyProxy's "together" holds a request for the others


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


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of a local server (`target`, http://host:port) that misbehaves on request,
    as object stores and trackers do: `fault` is None (pass through), "refuse" (close the connection at once), "500"
    (answer 500 Internal Server Error), "cut" (send the answer's headers and half its body, then close), "lose" (pass
    the request on, then close without its answer), "stall"
    (take the request, never answer) or "together" (hold each request until `times` of them, 2 if None, have come, up
    to TOGETHER_S, then pass them on at once: two clients' reads meet, as two nodes starting in the same second do,
    however loaded the machine); only for requests whose path holds `match`, after `after` of them passed, and
    `times` of them at most (None: all). `faults` counts the requests it spoiled. Set `fault` at any time; the proxy
    stops on exit.

        with FaultyProxy("http://127.0.0.1:5000", fault="500", match=".shard") as proxy:  # proxy.url to use instead
    """

    def __init__(self, target: str, fault: str | None = None, match: str = "", after: int = 0,
                 times: int | None = None):
        self.target, self.fault, self.match, self.after, self.times, self.faults = target, fault, match, after, times, 0
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._arrived = threading.Condition()

    def __enter__(self) -> "FaultyProxy":
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.fault_for(self.path)
                if fault == "refuse":
                    self.close_connection = True
                    return
                if fault == "stall":
                    proxy._stopped.wait()
                    self.close_connection = True
                    return
                if fault == "500":
                    payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.answer(500, [("Content-Type", "application/xml")], payload)
                    return
                if fault == "together":
                    proxy.meet()
                host, port = proxy.target.split("://", 1)[1].rsplit(":", 1)
                upstream = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                payload = answer.read()
                upstream.close()
                kept = [(k, v) for k, v in answer.getheaders()
                        if k.lower() not in ("transfer-encoding", "connection", "content-length")]
                if fault == "lose":  # done there, the answer lost: the client tries again
                    self.close_connection = True
                    return
                if fault == "cut":
                    self.answer(answer.status, kept, payload, cut=True)
                else:
                    self.answer(answer.status, kept, payload)

            def answer(self, status: int, headers: list, payload: bytes, cut: bool = False) -> None:
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload[: len(payload) // 2] if cut else payload)
                if cut:
                    self.wfile.flush()
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = handle_one

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def fault_for(self, path: str) -> str | None:
        if self.fault is None or self.match not in path:
            return None
        with self._lock:
            if self.after > 0 or (self.times is not None and self.faults >= self.times):
                self.after -= 1
                return None
            self.faults += 1
        return self.fault

    def meet(self) -> None:
        """Wait until `times` requests have come (each counted in fault_for), or TOGETHER_S."""
        with self._arrived:
            self._arrived.notify_all()
            self._arrived.wait_for(lambda: self.faults >= (self.times or 2), timeout=TOGETHER_S)

    def __exit__(self, *exc) -> None:
        with self._arrived:
            self._arrived.notify_all()
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
