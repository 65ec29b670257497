"""`python -m MODULE ARGS` as a real new process that starts warm: forked from a server that imported torch,
Lightning, torchvision, the library and MODULE once, instead of paying their ~10 s of imports (20-60 s on a loaded CI
machine) again.

Most of this suite's time on CI's two cores was interpreter starts. The child is a real process all the same: its own
pid, signals, kill -9, process group (start_new_session), exit status, stdout/stderr pipes, cwd, environment and
sys.path (cwd first, then PYTHONPATH, as `python -m` has them). What it is not is a fresh interpreter: a test about what
happens at interpreter start (imports, environment read at import, the README's own commands, torchrun, srun) starts
`sys.executable` itself. Ranks that Lightning's ddp launcher starts are fresh interpreters as always.

    python engine/tests/warm_python.py SOCKET MODULE   (by start(); it exits when the test process's pipe closes)
"""

import io
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time


class WarmProcess:
    """The subprocess.Popen calls the tests make (pid, poll, wait, communicate, send_signal, terminate, kill,
    returncode, stdout, stderr as text) for a child of the warm server."""

    def __init__(self, args: list[str], *, module: str, cwd, env: dict, new_session: bool, merge_stderr: bool,
                 timeout: float):
        self.args = [sys.executable, "-m", module, *args]
        self.returncode = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(_server(env, timeout, module))
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "new_session": new_session}
        socket.send_fds(self._conn, [json.dumps(request).encode()], [out_w, out_w if merge_stderr else err_w])
        os.close(out_w)
        os.close(err_w)
        self.pid = int(self._conn.recv(64))
        self.stdout = io.open(out_r, encoding="utf-8", errors="replace")
        self.stderr = io.open(err_r, encoding="utf-8", errors="replace")

    def poll(self) -> int | None:
        return self.wait(0, raise_timeout=False)

    def wait(self, timeout: float | None = None, *, raise_timeout: bool = True) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                status = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                if raise_timeout:
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                return None
            self.returncode = int(status)
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end (the child's children hold them too, as with Popen), then the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        texts: dict[str, str] = {}
        readers = [threading.Thread(target=lambda name=name: texts.__setitem__(name, getattr(self, name).read()),
                                    daemon=True) for name in ("stdout", "stderr")]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return texts["stdout"], texts["stderr"]

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stdout.close()
        self.stderr.close()
        self.wait()


def start(args: list[str], *, cwd, env: dict, module: str, new_session: bool = False,
          merge_stderr: bool = False, timeout: float = 300) -> WarmProcess:
    """Start `python -m MODULE ARGS` warm; `env` is the child's whole environment (as Popen's env=); merge_stderr:
    stderr into the stdout pipe (Popen's stderr=STDOUT: one stream, as a terminal shows it; .stderr reads nothing)."""
    return WarmProcess(args, module=module, cwd=cwd, env=env, new_session=new_session, merge_stderr=merge_stderr,
                       timeout=timeout)


def run(args: list[str], *, cwd, env: dict, timeout: float, module: str) -> subprocess.CompletedProcess:
    """subprocess.run(..., capture_output=True, text=True, timeout=timeout) of `python -m MODULE ARGS`, warm."""
    process = start(args, module=module, cwd=cwd, env=env, timeout=timeout)
    try:
        out, err = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


_SERVER: dict = {}


def _server(env: dict, timeout: float, module: str) -> str:
    """The socket of this test process's server, started on first use with this process's environment and the
    child's PYTHONPATH (a child's own variables are set after the imports: what reads them does so at call time), MODULE
    imported."""
    if "socket" not in _SERVER:
        path = os.path.join(tempfile.mkdtemp(prefix="warm-python-"), "socket")
        server_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": env.get("PYTHONPATH", "")}
        server = subprocess.Popen([sys.executable, __file__, path, module], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=server_env, text=True)
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm python server did not start (exit {server.wait(timeout)})")
        _SERVER.update(socket=path, process=server)  # its stdin pipe closes with this process: the server then exits
    return _SERVER["socket"]


def _serve(path: str, module: str) -> None:
    import importlib

    import lightning.pytorch  # noqa: F401  the imports each child would otherwise pay
    import torchmetrics  # noqa: F401
    import torchvision  # noqa: F401

    import classifier_engine.cli  # noqa: F401

    importlib.import_module(module)  # what the children run (the library's entry point, or a template's)

    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # the test process is gone: so are we (children run on)
                os._exit(0)
            if key.data == "accept":
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    _child(json.loads(message), fds, conn, base_path)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.send(str(pid).encode())
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:  # the test stopped waiting for it
                    pass
                conn.close()


def _child(request: dict, fds: list[int], conn: socket.socket, base_path: list[str]) -> None:
    """Become `python -m MODULE ARGS` in request's cwd and environment; exit as that process would."""
    conn.close()
    if request["new_session"]:
        os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, stdin), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *python_path, *base_path]
    import importlib
    import runpy
    import traceback

    importlib.invalidate_caches()
    sys.argv = ["-m", *request["args"]]
    code: object = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001  what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.exit(code)  # unwinds to the top of this file: the interpreter's own exit (threads joined, atexit, flush)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
