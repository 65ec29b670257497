"""The one Markdown table of bench/gpu_all.sh, from the parts its stages wrote so far, each row against its goal.

    python bench/gpu_table.py runs/gpu_all          # gpu_all.sh prints it after every stage; also after a cut run

Parts: meta.json (machine, versions), stages.tsv (each stage's exit code), jpegs.json, gpu-tests.xml (pytest -m gpu),
<stage>.json of the throughput stages (gpu_bench.py), overhead.json, augment.json (device_augment.py), fits.tsv +
fits/<name>/ (python -m project fit: perf/* read back by read_perf.py, the precision from its config.yaml). A
missing part becomes a row saying whether its stage has not run yet, ran out of time or failed, and which log to read.
"""

import argparse
import csv
import json
import sys
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

COLUMNS = ["measurement", "setting", "img/s", "MFU", "peak mem (GiB)", "step (ms)", "data wait", "ratio", "goal"]
SYNTHETIC_GOALS = {"bf16-mixed+cl": 3700, "bf16-mixed+cl+compile": 5000}
SETTINGS = {"bf16-mixed+cl": "bf16-mixed + channels_last",
            "bf16-mixed+cl+compile": "bf16-mixed + channels_last + compile",
            "16-mixed+cl": "16-mixed + channels_last"}  # also the order of the synthetic rows
GPU_DECODERS = ("nvjpeg", "torchcodec-cuda")
# gpu_all.sh's throughput stages, in its order, and the group (synthetic, GPU decode, CPU decode) their rows go to
THROUGHPUT_STAGES = {"synthetic": 0, "nvjpeg": 1, "torchcodec-cuda": 1, "cpu-decode": 2, "compile": 0}
GROUPS = ["synthetic", "real JPEGs, GPU decode", "real JPEGs, CPU decode"]
CUT = ("124", "137")  # timeout's exit codes: TERM at the limit, KILL 5 s after it
NOTES = """The fits run bf16-mixed + channels_last (fp16: 16-mixed) on JPEGs decoded by nvjpeg; 32-true: fp32 weights
and activations; on Ampere and newer cuDNN runs the convolutions in TF32 (torch's default,
torch.backends.cudnn.allow_tf32) and the final linear layer stays fp32. dp, ddp and fsdp on one device run the
single-device step through each strategy's wrapper: nothing is replicated or reduced across devices and an all-gather
copies one shard, so those rows show that the configs start and what the wrappers cost (fsdp's units: launches and
copies), not how they scale."""


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_codes(out: Path) -> dict[str, str]:
    try:
        return {name: code for name, code, *_ in csv.reader((out / "stages.tsv").read_text().splitlines(),
                                                            delimiter="\t")}
    except OSError:
        return {}


def missing(stage: str, codes: dict[str, str]) -> str:
    """Why a stage left no part: not run (yet), out of the budget, cut at its limit, or failed."""
    code = codes.get(stage)
    log = f"{stage}.log"
    if code is None:
        return "not run (yet)"
    if code == "budget":
        return "not run: the time budget was spent"
    if code in CUT:
        return f"cut at its time limit (exit {code}): see {log}"
    return f"exit {code}, no result: see {log}"


def rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def verdict(ok: bool, text: str, judged: bool) -> str:
    return f"{text}: {'met' if ok else 'NOT met'}" if judged else text


def throughput_rows(parts: dict, codes: dict[str, str], judged: bool) -> list[list[str]]:
    """Synthetic rows in SETTINGS' order, then the real ones, GPU decode first; a stage without a part says why."""
    order = {name: i for i, name in enumerate(SETTINGS)}
    placed = []  # (group, variant rank, row): sorted stably, so rows keep the stages' order within a place
    synthetic = {r["variant"]: r.get("images_per_sec") for part in parts.values() if part is not None
                 for r in part["rows"] if r["data"] == "synthetic"}
    for stage, part in parts.items():
        if part is None:
            group = THROUGHPUT_STAGES[stage]
            placed.append((group, order["bf16-mixed+cl+compile"] if stage == "compile" else -1,
                           [GROUPS[group], f"stage {stage}", missing(stage, codes), *[""] * 6]))
            continue
        for r in part["rows"]:
            real = r["data"] == "real"
            group = 0 if not real else 1 if r.get("decoder") in GPU_DECODERS else 2
            placed.append((group, order.get(r["variant"], len(order)), throughput_row(r, GROUPS[group], synthetic,
                                                                                      judged)))
    return [row for *_, row in sorted(placed, key=lambda item: item[:2])]


def throughput_row(r: dict, what: str, synthetic: dict, judged: bool) -> list[str]:
    real = r["data"] == "real"
    setting = SETTINGS.get(r["variant"], r["variant"])
    if r.get("precision") and not setting.startswith(r["precision"]):  # --tiny: every row in 32-true
        setting += f", run in {r['precision']}"
    if real and "decoder" in r:
        setting += f", decoder={r['decoder']}, workers: {r['workers']}"
    if "error" in r or "skipped" in r:
        return [what, setting, r.get("error") or r["skipped"], *[""] * 6]
    ratio, goal = "", ""
    if real and synthetic.get(r["variant"]):
        share = r["images_per_sec"] / synthetic[r["variant"]]
        ratio = f"{share:.2f} of synthetic"
        if r.get("decoder") in GPU_DECODERS:
            goal = verdict(share >= 0.9, ">= 0.9", judged)
    elif not real and r["variant"] in SYNTHETIC_GOALS:
        target = SYNTHETIC_GOALS[r["variant"]]
        goal = verdict(r["images_per_sec"] >= target, f">= {target:,} img/s", judged)
    return [what, setting, rate(r["images_per_sec"]), f"{100 * r['mfu']:.1f} %" if "mfu" in r else "-",
            f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-", f"{r['step_ms']:.1f}",
            f"{100 * r['data_wait']:.0f} %", ratio, goal]


def gpu_tests_row(out: Path, codes: dict[str, str], judged: bool) -> list[str]:
    setting = ("pytest -m gpu test_device_decode.py test_device_prefetch.py: decode vs the training stream's memory, "
               "GPU vs CPU batches, the prefetching loader's side stream")
    try:
        root = ElementTree.parse(out / "gpu-tests.xml").getroot()
    except (OSError, ElementTree.ParseError):
        return ["GPU tests", setting, missing("gpu-tests", codes), *[""] * 6]
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    bad = counts["failures"] + counts["errors"]
    passed = counts["tests"] - bad - counts["skipped"]
    text = f"{passed} passed, {bad} failed, {counts['skipped']} skipped"
    return ["GPU tests", setting, text, *[""] * 5, verdict(bad == 0 and passed > 0, "all pass", judged) +
            ("" if bad == 0 else ": see gpu-tests.log")]


def overhead_row(part, codes: dict[str, str], judged: bool) -> list[str]:
    if part is None:
        return ["Trainer / plain loop", "-", missing("overhead", codes), *[""] * 6]
    setting = (f"{part['arch']} {part['image_size']} px, batch {part['batch_size']}, {part['precision']}"
               f"{' + channels_last' if part.get('channels_last') else ''}, {part['paired_steps']} turns of "
               f"{part.get('block', 1)} steps; losses {'agree' if part['losses_agree'] else 'DISAGREE'} "
               f"({part['loss_rel_diff']:.1e})")
    step = f"{1e3 * part['ours_step_s']:.1f} / {1e3 * part['plain_step_s']:.1f}"
    return ["Trainer / plain loop", setting, rate(part["ours_images_per_sec"]), "", "", step, "",
            f"{part['ratio']:.3f}", verdict(part["ratio"] <= 1.02, "<= 1.02", judged)]


def augment_rows(part, codes: dict[str, str]) -> list[list[str]]:
    if part is None:
        return [["device augmentation", "-", missing("augment", codes), *[""] * 6]]
    rows = []
    for preset, paths in part["results"].items():
        per_image, batched = paths["per image"], paths["batch-wise"]
        rows.append([f"device augmentation, {preset}", f"{part['batch']} images ({part['distinct_sizes']} sizes): "
                     f"{per_image['launches']} launches image by image, {batched['launches']} batch-wise",
                     rate(1e3 * part["batch"] / batched["ms"]), "", "", f"{batched['ms']:.1f} / {per_image['ms']:.1f}",
                     "", f"{per_image['ms'] / batched['ms']:.1f}x faster", ""])
    return rows


def fit_config(run_dir: Path) -> dict:
    """The trainer section LightningCLI saved for a fit (its newest version), or {} before it got that far."""
    configs = sorted(run_dir.glob("lightning_logs/version_*/config.yaml"), key=lambda p: p.stat().st_mtime)
    try:
        return (yaml.safe_load(configs[-1].read_text()) or {}).get("trainer") or {} if configs else {}
    except (OSError, yaml.YAMLError):
        return {}


def fit_setting(extra: str, trainer: dict, tf32: bool) -> str:
    """The command's arguments, the precision the fit ran in, and what a one-device strategy row does not show."""
    if not trainer:
        return f"--config {extra.strip()}"
    precision = str(trainer.get("precision") or "32-true")  # None: Lightning's default
    if precision in ("32-true", "32") and tf32:
        precision += " (TF32 convolutions)"
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):  # a class_path with init_args: its name and what the fit set
        options = ", ".join(f"{k}={v}" for k, v in (strategy.get("init_args") or {}).items() if f".{k}=" in extra)
        strategy = f"{str(strategy.get('class_path')).rpartition('.')[2]}({options})"
    one_device = str(trainer.get("devices")) == "1" and strategy not in (None, "auto")
    return f"--config {extra.strip()}; {precision}" + (f"; {strategy} on one device: no replication or collective"
                                                          if one_device else "")


def fit_rows(out: Path, tf32: bool) -> list[list[str]]:
    try:
        fits = list(csv.reader((out / "fits.tsv").read_text().splitlines(), delimiter="\t"))
    except OSError:
        return [["fit", "-", "not run (yet)", *[""] * 6]]
    rows = []
    for name, code, extra in fits:
        perf = {}
        if code == "0":
            from read_perf import summary  # TensorBoard's reader: imported only once a fit has finished

            perf = summary(out / "fits" / name, skip=1)
        status = "exit 0" if code == "0" else f"exit {code}{' (time limit)' if code in CUT else ''}: fits/{name}.log"
        if code == "skipped":
            status = "not with --tiny: the engine's tests run it"
        elif code == "budget":
            status = "not run: the time budget was spent"
        img = rate(perf["perf/images_per_sec"]) if "perf/images_per_sec" in perf else status
        mfu = f"{100 * perf['perf/device/mfu']:.1f} %" if "perf/device/mfu" in perf else "-"
        step = f"{1e3 * perf['perf/step_time']:.1f}" if "perf/step_time" in perf else ""
        wait = f"{100 * perf['perf/data_wait']:.0f} %" if "perf/data_wait" in perf else ""
        setting = fit_setting(extra, fit_config(out / "fits" / name), tf32)
        rows.append([f"fit: {name}", setting, img, mfu, "", step, wait, "", status])
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder bench/gpu_all.sh wrote its parts into")
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run: goals are not judged")
    args = parser.parse_args(argv)
    meta, jpegs = load(args.out / "meta.json") or {}, load(args.out / "jpegs.json") or {}
    judged = not args.tiny
    codes = stage_codes(args.out)
    parts = {name: load(args.out / f"{name}.json") for name in THROUGHPUT_STAGES}
    rows = [gpu_tests_row(args.out, codes, judged), *throughput_rows(parts, codes, judged),
            overhead_row(load(args.out / "overhead.json"), codes, judged),
            *augment_rows(load(args.out / "augment.json"), codes), *fit_rows(args.out, meta.get("tf32", False))]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tiny = "CPU smoke run (--tiny: resnet18, 32 px, 32-true; the figures mean nothing)"
    title = tiny if args.tiny else meta.get("gpu", "?")
    print(f"# bash bench/gpu_all.sh{' --tiny' if args.tiny else ''}: {title}, {when}\n")
    generated = f"JPEGs generated in {jpegs['jpeg_seconds']} s" if jpegs else f"JPEGs: {missing('jpegs', codes)}"
    versions = ", ".join(f"{key} {value}" for key, value in meta.items() if key not in ("gpu", "tf32"))
    print("; ".join(part for part in (versions, generated) if part) + "\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join(["---"] * 2 + ["---:"] * 6 + ["---"]) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n" + NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
