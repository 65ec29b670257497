"""A real two-node Slurm cluster on this host for the `slurm` tests: private munged, slurmctld, `slurmd -N n1/-N n2`.

    python tests/slurm_cluster.py /tmp/slurm-test   # by hand: prints the SLURM_CONF to export; Enter stops it

Debian's slurmd is built with multiple-slurmd support, so two slurmd daemons on one host are two nodes. Everything lives
in one directory (config, state, spool, logs) and a private munge dir in /tmp; the daemons run in the foreground as
children of this process and are stopped by PID. The only change outside that directory is one marked /etc/hosts line
that maps the node names to 127.0.0.1 (Lightning turns SLURM_JOB_NODELIST into MASTER_ADDR); stop() removes exactly that
line.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

NODES = ("n1", "n2")
HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# added by tests/slurm_cluster.py"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")
CTLD_PORT = 16817
SLURMD_PORTS = (17001, 17002)

# Why each non-default key is there:
#   cred_expire=5  a requeued job may start again only cred_expire seconds later (default 120)
#   config_overrides  lets both emulated nodes claim more CPUs than the host has
#   sched_interval=1  the full scheduling pass (default every 60 s) starts a requeued job once its BeginTime passed
#   KillWait=2  a requeued job's tasks get SIGTERM, then SIGKILL after KillWait (default 30); Lightning's auto-requeue
#               ignores that SIGTERM, so the tasks always wait for the SIGKILL
SLURM_CONF = """\
ClusterName=projecttest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port=[{port_lo}-{port_hi}] CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def unavailable_reason() -> Optional[str]:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}): run `bash .ci/install_slurm.sh` as root"
    if os.geteuid() != 0:
        return "the test cluster runs slurmd as root (SlurmdUser=root) and edits /etc/hosts: run the tests as root"
    return None


@dataclass
class SlurmCluster:
    """Handles to a running cluster: `env` makes the Slurm client commands talk to it."""

    root: Path
    env: dict[str, str]
    munge_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    added_hosts_line: bool = False

    def command(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run a Slurm client command (sbatch, squeue, scontrol, scancel) against this cluster; its stdout."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, *args: str, cwd: Path, env: Optional[dict[str, str]] = None) -> int:
        """Submit; the job id. `env` is added to the environment the job is submitted with (sbatch exports it)."""
        result = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                                capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RestartCnt, NodeList, ExitCode, ...)."""
        text = self.command("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, job_id: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Poll until the job reaches one of `states` (RUNNING, COMPLETED, FAILED, ...); its last record."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout:.0f} s, expected {states}")
            time.sleep(0.5)

    def wait_until_done(self, job_id: int, timeout: float) -> dict[str, str]:
        return self.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
                             timeout)


def _write_munge_dir() -> Path:
    """A munge-owned dir for the socket, holding a 0700 key dir with a private key.

    Not under the cluster root: munged (running as munge) refuses a socket dir that not everyone can traverse, and
    pytest's tmp dirs are 0700 root. A short /tmp path also keeps the socket path under the 108-byte limit.
    """
    import pwd

    munge = pwd.getpwnam("munge")
    directory = Path(tempfile.mkdtemp(prefix="slurm-munge-"))
    key_dir = directory / "key"
    key_dir.mkdir()
    key = key_dir / "munge.key"
    if not key.exists():
        if Path("/etc/munge/munge.key").exists():
            shutil.copyfile("/etc/munge/munge.key", key)
        else:
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
    for path in (directory, key_dir, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    directory.chmod(0o755)
    key_dir.chmod(0o700)
    key.chmod(0o400)
    return directory


def _add_hosts_line() -> bool:
    """Map the node names to 127.0.0.1 unless they resolve already; True when the line is ours to remove."""
    if HOSTS_MARK in HOSTS.read_text():
        return True  # left by a run that was killed before stop(): adopt it, so this stop() removes it
    try:
        if all(socket.gethostbyname(node) == "127.0.0.1" for node in NODES):
            return False
    except OSError:
        pass
    with HOSTS.open("a") as hosts:
        hosts.write(f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")
    return True


def _remove_hosts_line() -> None:
    lines = HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if HOSTS_MARK not in line]
    if kept != lines:
        HOSTS.write_text("".join(kept))


def _wait_for_nodes(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = cluster.command("sinfo", "-h", "-N", "-o", "%N %t", check=False).split("\n")
        idle = {line.split()[0] for line in states if line.strip() and line.split()[1] in ("idle", "mix", "alloc")}
        if idle >= set(NODES):
            return
        for name, process in cluster.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited {process.returncode}; see {cluster.root / 'log'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes not idle after {timeout:.0f} s (sinfo: {states}); see {cluster.root / 'log'}")
        time.sleep(0.3)


def start(root: Path, *, cpus: int = 4, timeout: float = 30) -> SlurmCluster:
    """Bring up munged, slurmctld and one slurmd per node under `root`; returns when every node is idle."""
    import pwd

    root = Path(root).resolve()
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    munge_dir = _write_munge_dir()
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, munge_dir=munge_dir, host=host, ctld_port=CTLD_PORT,
                                      nodes=f"n[1-{len(NODES)}]",
                                      port_lo=SLURMD_PORTS[0], port_hi=SLURMD_PORTS[-1], cpus=cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root=root, env=env, munge_dir=munge_dir)
    try:
        cluster.added_hosts_line = _add_hosts_line()
        munge = pwd.getpwnam("munge")
        cluster.processes["munged"] = subprocess.Popen(
            ["munged", "--foreground", f"--socket={munge_dir}/munge.socket", f"--key-file={munge_dir}/key/munge.key",
             f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
             f"--seed-file={munge_dir}/munged.seed"],
            user=munge.pw_uid, group=munge.pw_gid, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        _wait_for_path(munge_dir / "munge.socket", cluster.processes["munged"], timeout)
        log = (root / "log" / "daemons.out").open("ab")
        # -i: ignore the job state a previous run of this directory left (its jobs are gone).
        cluster.processes["slurmctld"] = subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=log, stderr=log)
        for node in NODES:
            cluster.processes[f"slurmd-{node}"] = subprocess.Popen(["slurmd", "-D", "-N", node], env=env,
                                                                   stdout=log, stderr=log)
        _wait_for_nodes(cluster, timeout)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _wait_for_path(path: Path, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.args[0]} did not create {path} (exit code {process.poll()})")
        time.sleep(0.05)


def stop(cluster: SlurmCluster, timeout: float = 10) -> None:
    """Cancel leftover jobs, stop the daemons this cluster started (by PID), remove the /etc/hosts line it added."""
    if cluster.processes.get("slurmctld") and cluster.processes["slurmctld"].poll() is None:
        subprocess.run(["scancel", "--full", "--user=root"], env=cluster.env, capture_output=True, timeout=10)
    # slurmd before slurmctld before munged: each needs the next one to shut down cleanly.
    for name in [n for n in cluster.processes if n.startswith("slurmd")] + ["slurmctld", "munged"]:
        process = cluster.processes.get(name)
        if process is None or process.poll() is not None:
            continue
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    cluster.processes.clear()
    shutil.rmtree(cluster.munge_dir, ignore_errors=True)
    if cluster.added_hosts_line:
        _remove_hosts_line()
        cluster.added_hosts_line = False


if __name__ == "__main__":
    reason = unavailable_reason()
    if reason:
        sys.exit(reason)
    running = start(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm-test"))
    print(f"export SLURM_CONF={running.env['SLURM_CONF']}\nup; press Enter to stop", flush=True)
    try:
        input()
    finally:
        stop(running)
