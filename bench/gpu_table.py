"""The one Markdown table of bench/gpu_all.sh, from the parts its stages wrote, each row against its goal.

    python bench/gpu_table.py runs/gpu_all          # what gpu_all.sh runs last; also after a partial run

Parts: meta.json (machine, versions), jpegs.json, throughput.json and compile.json (gpu_bench.py), overhead.json,
augment.json (device_augment.py), fits.tsv + fits/<name>/ (python -m project fit, perf/* read back by read_perf.py).
A missing part becomes a row saying which log to read.
"""

import argparse
import csv
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from read_perf import summary  # noqa: E402

COLUMNS = ["measurement", "setting", "img/s", "MFU", "peak mem (GiB)", "step (ms)", "data wait", "ratio", "goal"]
SYNTHETIC_GOALS = {"bf16-mixed+cl": 3700, "bf16-mixed+cl+compile": 5000}
SETTINGS = {"bf16-mixed+cl": "bf16-mixed + channels_last",
            "bf16-mixed+cl+compile": "bf16-mixed + channels_last + compile",
            "16-mixed+cl": "16-mixed + channels_last"}  # also the order of the synthetic rows
GPU_DECODERS = ("nvjpeg", "torchcodec-cuda")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def verdict(ok: bool, text: str, judged: bool) -> str:
    return f"{text}: {'met' if ok else 'NOT met'}" if judged else text


def throughput_rows(parts: dict, judged: bool) -> list[list[str]]:
    """Synthetic rows in SETTINGS' order, then the real ones; a part that is missing says which log to read."""
    found = [r for part in parts.values() if part is not None for r in part["rows"]]
    order = list(SETTINGS)
    found.sort(key=lambda r: (r["data"] == "real", order.index(r["variant"]) if r["variant"] in order else len(order)))
    missing = [name for name, part in parts.items() if part is None]
    rows = [["throughput", "-", f"not measured: see {name}.log", *[""] * 6] for name in missing]
    synthetic = {r["variant"]: r.get("images_per_sec") for r in found if r["data"] == "synthetic"}
    for r in found:
        real = r["data"] == "real"
        what = f"real JPEGs, {'GPU' if r.get('decoder') in GPU_DECODERS else 'CPU'} decode" if real else "synthetic"
        setting = SETTINGS.get(r["variant"], r["variant"]) + (f", decoder={r['decoder']}, workers: {r['workers']}"
                                                                if real and "decoder" in r else "")
        if "error" in r or "skipped" in r:
            rows.append([what, setting, r.get("error") or r["skipped"], *[""] * 6])
            continue
        ratio, goal = "", ""
        if real and synthetic.get(r["variant"]):
            share = r["images_per_sec"] / synthetic[r["variant"]]
            ratio = f"{share:.2f} of synthetic"
            if r.get("decoder") in GPU_DECODERS:
                goal = verdict(share >= 0.9, ">= 0.9", judged)
        elif not real and r["variant"] in SYNTHETIC_GOALS:
            target = SYNTHETIC_GOALS[r["variant"]]
            goal = verdict(r["images_per_sec"] >= target, f">= {target:,} img/s", judged)
        rows.append([what, setting, rate(r["images_per_sec"]), f"{100 * r['mfu']:.1f} %" if "mfu" in r else "-",
                     f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-", f"{r['step_ms']:.1f}",
                     f"{100 * r['data_wait']:.0f} %", ratio, goal])
    return rows


def overhead_row(part, judged: bool) -> list[str]:
    if part is None:
        return ["Trainer / plain loop", "-", "not measured: see overhead.log", *[""] * 6]
    setting = (f"{part['arch']} {part['image_size']} px, batch {part['batch_size']}, {part['precision']}"
               f"{' + channels_last' if part.get('channels_last') else ''}, {part['paired_steps']} turns of "
               f"{part.get('block', 1)} steps; losses {'agree' if part['losses_agree'] else 'DISAGREE'} "
               f"({part['loss_rel_diff']:.1e})")
    step = f"{1e3 * part['ours_step_s']:.1f} / {1e3 * part['plain_step_s']:.1f}"
    return ["Trainer / plain loop", setting, rate(part["ours_images_per_sec"]), "", "", step, "",
            f"{part['ratio']:.3f}", verdict(part["ratio"] <= 1.02, "<= 1.02", judged)]


def augment_rows(part) -> list[list[str]]:
    if part is None:
        return [["device augmentation", "-", "not measured: see augment.log", *[""] * 6]]
    rows = []
    for preset, paths in part["results"].items():
        per_image, batched = paths["per image"], paths["batch-wise"]
        rows.append([f"device augmentation, {preset}", f"{part['batch']} images ({part['distinct_sizes']} sizes): "
                     f"{per_image['launches']} launches image by image, {batched['launches']} batch-wise",
                     rate(1e3 * part["batch"] / batched["ms"]), "", "", f"{batched['ms']:.1f} / {per_image['ms']:.1f}",
                     "", f"{per_image['ms'] / batched['ms']:.1f}x faster", ""])
    return rows


def fit_rows(out: Path) -> list[list[str]]:
    try:
        fits = list(csv.reader((out / "fits.tsv").read_text().splitlines(), delimiter="\t"))
    except OSError:
        return [["fit", "-", "not run: see the gpu_all output", *[""] * 6]]
    rows = []
    for name, code, extra in fits:
        perf = summary(out / "fits" / name, skip=1) if code == "0" else {}
        status = "exit 0" if code == "0" else f"exit {code}{' (time limit)' if code == '124' else ''}: fits/{name}.log"
        if code == "skipped":
            status = "not with --tiny: tests/test_strategies.py builds it"
        img = rate(perf["perf/images_per_sec"]) if "perf/images_per_sec" in perf else status
        mfu = f"{100 * perf['perf/device/mfu']:.1f} %" if "perf/device/mfu" in perf else "-"
        step = f"{1e3 * perf['perf/step_time']:.1f}" if "perf/step_time" in perf else ""
        wait = f"{100 * perf['perf/data_wait']:.0f} %" if "perf/data_wait" in perf else ""
        rows.append([f"fit: {name}", f"--config {extra.strip()}", img, mfu, "", step, wait, "", status])
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder bench/gpu_all.sh wrote its parts into")
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run: goals are not judged")
    args = parser.parse_args(argv)
    meta, jpegs = load(args.out / "meta.json") or {}, load(args.out / "jpegs.json") or {}
    judged = not args.tiny
    parts = {name: load(args.out / f"{name}.json") for name in ("throughput", "compile")}
    rows = [*throughput_rows(parts, judged), overhead_row(load(args.out / "overhead.json"), judged),
            *augment_rows(load(args.out / "augment.json")), *fit_rows(args.out)]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tiny = "CPU smoke run (--tiny: resnet18, 32 px, 32-true; the figures mean nothing)"
    title = tiny if args.tiny else meta.get("gpu", "?")
    print(f"# bash bench/gpu_all.sh{' --tiny' if args.tiny else ''}: {title}, {when}\n")
    print(", ".join(f"{key} {value}" for key, value in meta.items() if key != "gpu")
          + (f"; JPEGs generated in {jpegs['jpeg_seconds']} s" if "jpeg_seconds" in jpegs else "") + "\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join(["---"] * 2 + ["---:"] * 6 + ["---"]) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
