"""Preemptible anywhere, measured: a run stopped and resumed on other world sizes against the uninterrupted one, and
run dirs on object storage (checkpoint upload throughput, signal to durable checkpoint) against local disk.

    python bench/preemption.py              # ~4 min on 2 cores: all three parts
    python bench/preemption.py --quick      # 1 round each: a smoke run

Part 1 (CPU, gloo): --global_batch_size 12 over 100 numbered images, 2 epochs (16 steps): uninterrupted on 1 rank;
then killed (-9) on 1 rank at step 5, resumed on 2, killed at step 11, resumed on 3. Which images each step trained on
(recorded), and the weights and momenta apart (relative L2). Part 2: a ResNet-18 and a ResNet-50 training checkpoint
(weights, SGD momentum) saved to local disk by AtomicCheckpointIO and uploaded to a moto S3 server on 127.0.0.1 by the
run's uploader (run/remote_runs.py); median seconds and MiB/s. Part 3: the quickstart's fit (ResNet-18, 32 px) held at
step 3, SIGTERM, and the stop line's "durable N s after the signal", s3:// root against a local one, in turns.
Results with the exact command: docs/benchmarks.md, "Preemption".
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine" / "tests"))  # local_services, recorded_samples, stop_callbacks
from local_services import s3_server  # noqa: E402
from recorded_samples import read_records  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "engine" / "tests"), str(REPO)]),
       "PYTHONUNBUFFERED": "1"}


def fit(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "project", "fit", *args], cwd=REPO, env={**ENV, **(env or {})},
                          capture_output=True, text=True)


def callback(class_path: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def world_sizes(work: Path) -> dict:
    common = ["--model.class_path=plain_model.Top1Net", "--model.init_args.width=8",
              "--data.class_path=recorded_samples.NumberedImages", "--data.init_args.batch_size=6",
              "--trainer.accelerator=cpu", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false",
              "--global_batch_size=12", "--last_checkpoint.every_n_steps=1"]
    ranks = {n: [f"--trainer.devices={n}", "--trainer.strategy=" + ("ddp" if n > 1 else "auto")] for n in (1, 2, 3)}
    record = lambda tag: callback("recorded_samples.RecordSamples", folder=str(work / tag))  # noqa: E731
    started = time.perf_counter()
    assert fit([*common, *ranks[1], f"--trainer.default_root_dir={work / 'ref'}", record("ref")]).returncode == 0
    runs = [(1, 5, []), (2, 11, ["--ckpt_path=last"]), (3, None, ["--ckpt_path=last"])]
    for index, (n, kill_at, extra) in enumerate(runs):
        kill = [callback("stop_callbacks.SignalAtStep", step=kill_at)] if kill_at else []
        result = fit([*common, *ranks[n], f"--trainer.default_root_dir={work / 'run'}", record(f"part{index}"), *extra,
                      *kill])
        assert (result.returncode == 0) == (kill_at is None), result.stderr[-2000:]
    seen: dict[int, list[int]] = {}
    for tag, lo, hi in (("part0", 0, 5), ("part1", 5, 11), ("part2", 11, 16)):
        for r in read_records(work / tag):
            if lo <= r["step"] < hi:
                seen.setdefault(r["step"], []).extend(r["ids"])
    reference: dict[int, list[int]] = {}
    for r in read_records(work / "ref"):
        reference.setdefault(r["step"], []).extend(r["ids"])
    epochs = [[i for s in range(8 * e, 8 * e + 8) for i in seen[s]] for e in (0, 1)]
    state = lambda root: torch.load(root / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)  # noqa
    a, b = state(work / "run"), state(work / "ref")
    tensors = lambda c: {**c["state_dict"], **{f"m{k}": v["momentum_buffer"] for k, v in  # noqa: E731
                                              c["optimizer_states"][0]["state"].items()}}
    ta, tb = tensors(a), tensors(b)
    distance = sum(float((ta[k].double() - tb[k].double()).pow(2).sum()) for k in tb) ** 0.5
    norm = sum(float(tb[k].double().pow(2).sum()) for k in tb) ** 0.5
    return {"steps_alike": sum(sorted(seen[s]) == sorted(reference[s]) for s in reference), "steps": len(reference),
            "images_per_epoch": [len(e) for e in epochs], "distinct_per_epoch": [len(set(e)) for e in epochs],
            "relative_distance": distance / norm, "final_step": a["global_step"],
            "seconds": round(time.perf_counter() - started, 1)}


def uploads(work: Path, rounds: int, store: dict) -> list[dict]:
    from classifier_engine.run.checkpoint_io import AtomicCheckpointIO
    from classifier_engine.run.remote_runs import RemoteRoot
    from torchvision.models import resnet18, resnet50

    os.environ.update(store)
    rows = []
    for name, network in (("resnet18", resnet18()), ("resnet50", resnet50())):
        momentum = {i: {"momentum_buffer": p.detach().clone()} for i, p in enumerate(network.parameters())}
        checkpoint = {"state_dict": network.state_dict(), "optimizer_states": [{"state": momentum}],
                      "global_step": 1, "epoch": 0}
        io, remote = AtomicCheckpointIO(), RemoteRoot("s3://runs/bench")
        remote.mirror = work / "mirror"
        path = remote.mirror / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        local, upload = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            io.save_checkpoint(checkpoint, path)
            local.append(time.perf_counter() - started)
            upload.append(remote.upload(path, (time.time(), 1, 0, 1)))
        mib = path.stat().st_size / 2**20
        rows.append({"checkpoint": name, "MiB": round(mib, 1), "local_save_s": round(statistics.median(local), 3),
                     "upload_s": round(statistics.median(upload), 3),
                     "upload_MiB_per_s": round(mib / statistics.median(upload), 1)})
    return rows


def signal_to_durable(work: Path, rounds: int, store: dict) -> dict:
    from conftest import write_image_folder

    data = work / "digits"

    write_image_folder(data, {"cat": (14, 6), "dog": (13, 6), "fox": (13, 5)})
    found: dict[str, list[float]] = {"s3": [], "local": []}
    for index in range(rounds):
        for kind in ("s3", "local"):
            root = f"s3://runs/stop{index}" if kind == "s3" else str(work / f"stop{kind}{index}")
            marker = work / f"holding-{kind}-{index}"
            command = [sys.executable, "-m", "project", "fit", "--config", "configs/quickstart.yaml",
                       f"--data.root={data}", "--data.batch_size=8", "--trainer.max_epochs=3",
                       "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}",
                       callback("stop_callbacks.HoldUntilSignalled", step=3, marker=str(marker))]
            env = {**ENV, **store, "CLASSIFIER_ENGINE_RUN_MIRROR": str(work / "mirrors" / str(index))}
            job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
            while not marker.exists() and job.poll() is None:
                time.sleep(0.05)
            job.send_signal(signal.SIGTERM)
            out, _ = job.communicate(timeout=600)
            line = next(line for line in out.splitlines() if line.startswith("stopped by SIGTERM"))
            found[kind].append(float(line.split(", durable ")[1].split(" s after")[0]))
    return {kind: {"median_s": statistics.median(values), "all_s": values} for kind, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of each part")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    rounds = 1 if args.quick else 5
    with tempfile.TemporaryDirectory() as folder, s3_server(bucket="runs", authenticated=False) as store:
        work = Path(folder)
        results = {"world_sizes": world_sizes(work), "uploads": uploads(work, rounds, store),
                   "signal_to_durable": signal_to_durable(work, 1 if args.quick else 3, store),
                   "torch": torch.__version__, "cpus": os.cpu_count()}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
