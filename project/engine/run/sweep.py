"""Hyperparameter sweeps with Optuna: every trial an ordinary fit in its own run dir, any number of workers per study.

    python -m project sweep --config configs/sweep/quickstart.yaml                 # a worker; start more to share it
    python -m project sweep --summary --config configs/sweep/quickstart.yaml       # trials.csv, plots, the best
    python -m project sweep --help                                                 # the sweep settings

A sweep file is a fit config with a `sweep:` section (DEFAULTS below); docs/sweeps.md says how it runs.
"""

import argparse
import contextlib
import difflib
import io
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
import yaml

from project.engine.errors import ConfigError, check_config_files, user_message
from project.engine.run.sweep_trials import (
    BEST,
    CHECKPOINT,
    RUN_DIR,
    WORKER,
    Worker,
    instantiate,
    open_storage,
    param_flags,
)

# What ImageClassifier logs at each validation (`<stage>/loss`, `/acc1`, `/acc5` in model._evaluate).
VAL_METRICS = ("val/loss", "val/acc1", "val/acc5")
SETTINGS: dict[str, tuple[Any, str]] = {  # the `sweep:` section: default, help
    "study": (None, "the study's name and folder under <default_root_dir>/sweeps/ (default: the sweep file's name)"),
    "storage": (None, "<study dir>/journal.log by default; another journal file, or an RDB URL (sqlite:///x.db)"),
    "direction": (None, "maximize or minimize (default: minimize a loss, maximize the rest)"),
    "metric": ("val/acc1", f"what a trial is scored on, its best over its validations: {', '.join(VAL_METRICS)}"),
    "n_trials": (20, "the study's number of trials, shared by all its workers"),
    "sampler": (None, "an Optuna sampler, {class_path: TPESampler, init_args: {...}} (default: TPESampler)"),
    "pruner": (None, "an Optuna pruner, {class_path: MedianPruner, init_args: {...}} (default: MedianPruner)"),
    "space": ({}, "fit options by dotted name: {low: 0.01, high: 1.0, log: true} (step: ...) or {choices: [...]}"),
    "configs": ([], "fit config files applied where the sweep file stands"),
    "heartbeat_interval": (30.0, "seconds between a worker's heartbeats on its trial"),
    "grace_period": (120.0, "a running trial silent this long is failed and retried from its last.ckpt"),
    "max_retry": (10, "retries of a trial whose worker died or was preempted; then it stays failed"),
    "launcher": (None, "prefix of each trial's command, e.g. \"srun --kill-on-bad-exit=1\" (slurm/sweep.sbatch)"),
}
DEFAULTS = {key: default for key, (default, _) in SETTINGS.items()}
USAGE = "usage: python -m project sweep --config SWEEP_FILE [--sweep.KEY=VALUE ...] [--summary] [FIT OPTIONS ...]"


def help_text() -> str:
    """`python -m project sweep --help`."""
    lines = [USAGE, "", __doc__.strip().splitlines()[0], "", "sweep settings (the sweep file's `sweep:` section, or "
             "--sweep.KEY=VALUE):"]
    lines += [f"  {key:<19}{text}" for key, (_, text) in SETTINGS.items()]
    return "\n".join([*lines, "", "  --summary          write trials.csv and the plots, print the best trial; run no "
                       "trial", "", "Every other option is a fit option: python -m project fit --help. Examples: "
                       "configs/sweep/*.yaml; how it runs: docs/sweeps.md."])


def main(argv: list[str], cli_main: Callable[..., Any]) -> None:
    """`python -m project sweep ARGV`: check everything, run this worker's share of the study, print the summary.
    `cli_main`: project.engine.cli's, handed in by project/__main__.py (the run wing does not import the CLI)."""
    if {"-h", "--help"} & set(argv):
        print(help_text())
        return
    check_config_files(argv)
    sweep, fit_args, summary_only = read_command_line(argv)
    sampler = check_sweep(sweep)
    resolved = resolve_fit_options(fit_args, sweep["space"], cli_main)
    study_dir = Path(resolved["trainer"].get("default_root_dir") or ".") / "sweeps" / sweep["study"]
    storage = sweep["storage"] or str(study_dir / "journal.log")
    study = open_study(sweep, storage, study_dir, sampler, create=not summary_only)
    code = 0
    if not summary_only:
        study_dir.mkdir(parents=True, exist_ok=True)  # with an RDB storage too: the trials' run dirs, the summary
        code = Worker(study, storage, study_dir, fit_args, sweep, resolved["trainer"].get("logger")).run()
        if code == 2:  # a trial's bad input: its error stays the last line
            sys.exit(code)
    print(summarize(study, study_dir, sweep), flush=True)
    if code:
        sys.exit(code)


def read_command_line(argv: list[str]) -> tuple[dict, list[str], bool]:
    """(the sweep section with its defaults and --sweep.* overrides, the fit options in order, --summary given)."""
    fit_args, section, summary, i = [], None, False, 0
    overrides: dict[str, Any] = {}
    while i < len(argv):
        arg = argv[i]
        if arg == "--summary":
            summary = True
        elif arg in ("--config", "-c") or arg.startswith(("--config=", "-c=")):
            path = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            i += "=" not in arg
            with open(path) as file:
                content = yaml.safe_load(file)
            if not (isinstance(content, dict) and "sweep" in content):
                fit_args += ["--config", path]
                i += 1
                continue
            if section is not None:
                raise ConfigError(f"{path}: a second sweep file; one `sweep:` section per command (override its keys "
                                  "with --sweep.KEY=VALUE)")
            section = content.pop("sweep") or {}
            configs = section.get("configs") or [] if isinstance(section, dict) else None
            if not isinstance(section, dict) or not isinstance(configs, list):
                raise ConfigError(f"{path}: `sweep:` must be a mapping of {', '.join(DEFAULTS)}; `configs` a list of "
                                  "files")
            section.setdefault("study", Path(path).stem)
            check_config_files([f"--config={c}" for c in configs])
            fit_args += [a for c in configs for a in ("--config", c)]
            fit_args += [f"--{key}={json.dumps(value)}" for key, value in content.items()]  # its own fit options
        elif arg.startswith("--sweep."):
            if "=" not in arg:
                raise ConfigError(f"{arg}: write sweep settings as --sweep.KEY=VALUE (a YAML value)")
            key, value = arg[len("--sweep."):].split("=", 1)
            overrides[key] = yaml.safe_load(value)
        else:
            fit_args.append(arg)
        i += 1
    if section is None:
        raise ConfigError("no sweep file: pass --config configs/sweep/<name>.yaml (a YAML file with a `sweep:` "
                          "section)")
    sweep = {**DEFAULTS, **section}
    for key, value in overrides.items():
        if key.startswith("space."):
            sweep["space"] = {**(sweep["space"] or {}), key[len("space."):]: value}
        else:
            sweep[key] = value
    unknown = sorted(set(sweep) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"sweep.{unknown[0]} is not a sweep setting; they are: {', '.join(DEFAULTS)}")
    return sweep, fit_args, summary


# -- the checks, before anything is written --------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sweep(sweep: dict):
    """ConfigError for a setting that cannot work; fills in the direction; the sampler (None: Optuna's default)."""
    study, metric, space = sweep["study"], sweep["metric"], sweep["space"]
    if not isinstance(study, str) or not study or "/" in study or study.startswith("."):
        raise ConfigError(f"sweep.study {study!r}: expected a name (it is the study's folder under sweeps/)")
    if metric not in VAL_METRICS:
        raise ConfigError(f"sweep.metric {metric!r} is never logged: a trial's fit logs {', '.join(VAL_METRICS)} at "
                          "each validation")
    sweep["direction"] = sweep["direction"] or ("minimize" if metric.endswith("loss") else "maximize")
    if sweep["direction"] not in ("maximize", "minimize"):
        raise ConfigError(f"sweep.direction {sweep['direction']!r}: expected maximize or minimize")
    for key, low in (("n_trials", 1), ("max_retry", 0)):
        if not (isinstance(sweep[key], int) and _number(sweep[key]) and sweep[key] >= low) and sweep[key] is not None:
            raise ConfigError(f"sweep.{key} {sweep[key]!r}: expected an integer >= {low}")
    if sweep["n_trials"] is None:
        raise ConfigError("sweep.n_trials: expected the study's number of trials, an integer >= 1")
    interval, grace = sweep["heartbeat_interval"], sweep["grace_period"]
    if not (_number(interval) and _number(grace) and 0 < interval < grace):
        raise ConfigError(f"sweep.heartbeat_interval {interval!r}, grace_period {grace!r}: expected seconds, the grace "
                          "period longer than the interval (a few heartbeats)")
    if not isinstance(space, dict) or not space:
        raise ConfigError("sweep.space is empty: name fit options and their ranges, e.g. "
                          "`model.optim.lr_per_256: {low: 0.01, high: 1.0, log: true}`")
    for name, spec in space.items():
        check_range(f"sweep.space.{name}", spec)
    if sweep["pruner"] is not None:
        instantiate(sweep["pruner"], "optuna.pruners", "pruner")  # each trial's fit builds its own
    if sweep["sampler"] is None:
        return None
    sampler = instantiate(sweep["sampler"], "optuna.samplers", "sampler")
    if isinstance(sampler, optuna.samplers.GridSampler):
        grid = sweep["sampler"]["init_args"]["search_space"]
        if set(grid) != set(space):
            raise ConfigError(f"sweep.sampler: the GridSampler's grid names {sorted(grid)}, sweep.space names "
                              f"{sorted(space)}: give the grid one list of values per entry of the space")
        size = math.prod(len(values) for values in grid.values())
        if sweep["n_trials"] > size:  # then Optuna repeats points, and its stop() ends the worker with a traceback
            print(f"sweep: n_trials {sweep['n_trials']} > the grid's {size} points: n_trials {size}", flush=True)
            sweep["n_trials"] = size
    return sampler


def check_range(where: str, spec: Any) -> None:
    """One search-space entry: `{choices: [...]}`, or `{low, high}` with optional `log` and `step`."""
    keys = set(spec) if isinstance(spec, dict) else set()
    if keys == {"choices"} and isinstance(spec["choices"], list):
        choices = spec["choices"]
        if len(choices) < 2:
            raise ConfigError(f"{where}: {len(choices)} choice(s) is an empty search; give two or more, or set the "
                              "option as an ordinary fit option")
        if any(c is not None and not isinstance(c, (bool, int, float, str)) for c in choices):
            raise ConfigError(f"{where}: choices must be plain values (null, numbers, strings, booleans), got "
                              f"{choices!r}")
        return
    if not ({"low", "high"} <= keys <= {"low", "high", "log", "step"}):
        raise ConfigError(f"{where}: expected {{low: ..., high: ...}} (and log, step) or {{choices: [...]}}, got "
                          f"{spec!r}")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    if not (_number(low) and _number(high)):
        raise ConfigError(f"{where}: low and high must be numbers, got {low!r} and {high!r}")
    if not (step is None or (_number(step) and step > 0)) or not isinstance(log, bool):
        raise ConfigError(f"{where}: step must be a positive number and log true or false, got {step!r} and {log!r}")
    if low > high:
        raise ConfigError(f"{where}: inverted range, low {low} > high {high}; swap them")
    if low == high or (step is not None and high - low < step):
        raise ConfigError(f"{where}: empty range [{low}, {high}]" + (f" with step {step}" if step else "")
                          + "; widen it, or set the option as an ordinary fit option")
    if log and (low <= 0 or step is not None):  # Optuna refuses a step on a log scale (at the first trial)
        raise ConfigError(f"{where}: a log range needs low > 0 and no step, got low {low}, step {step}; drop step "
                          "or log")


def print_config(args: list[str], cli_main: Callable[..., Any]) -> dict:
    """The fit's config for `args` as the real fit parser resolves it (`python -m project fit --print_config`)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LightningCLI: "args given in-process while sys.argv holds others"
            cli_main(["fit", "--print_config", *args])
    except SystemExit as error:
        if error.code not in (0, None):
            raise ConfigError(f"the fit options do not parse (exit {error.code})") from None
    except (argparse.ArgumentError, ConfigError, ValueError, TypeError) as error:
        raise ConfigError(" ".join((user_message(error) or f"{type(error).__name__}: {error}").split())) from None
    return yaml.safe_load(out.getvalue())


def option_names(config: dict, prefix: str = "") -> dict[str, Any]:
    """Every option of a resolved config by its dotted name (groups too), with its value."""
    names: dict[str, Any] = {}
    for key, value in config.items():
        names[prefix + key] = value
        if isinstance(value, dict):
            names.update(option_names(value, f"{prefix}{key}."))
            if isinstance(value.get("init_args"), dict):  # a class by class_path: model.x is model.init_args.x
                names.update(option_names(value["init_args"], f"{prefix}{key}."))
    return names


def resolve_fit_options(fit_args: list[str], space: dict[str, dict], cli_main: Callable[..., Any]) -> dict:
    """The config every trial starts from, by the real fit parser; ConfigError for an option it refuses, a name in
    the space that is not a fit option, or a value of the space the option does not accept."""
    try:
        config = print_config(fit_args, cli_main)
    except ConfigError as error:
        raise ConfigError(f"fit options of the sweep: {error}") from None
    names = option_names(config)
    for key in ("ckpt_path", "checkpoint.dirpath"):
        if names.get(key):
            raise ConfigError(f"--{key} cannot be given to a sweep: each trial's run dir decides it; leave it out")
    if names.get("trainer.limit_val_batches") not in (None, 1.0):
        raise ConfigError(f"trainer.limit_val_batches {names['trainer.limit_val_batches']}: trials would score on the "
                          "first batches of the validation split, other images for another data.batch_size; sweeps "
                          "score on the whole split: drop it (or make the split itself smaller)")
    for name in space:
        if name not in names:
            near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"sweep.space.{name} is not a fit option{hint}; `python -m project fit --print_config` "
                              "lists them")
        if isinstance(names[name], dict):
            raise ConfigError(f"sweep.space.{name} is a group of options: sweep one of them, e.g. "
                              f"{next(iter(option_names(names[name], name + '.')), name)}")
    # Every value the space can give goes through the parser: the ends of the ranges and every choice, several at once.
    values = {name: spec.get("choices") or [spec["low"], spec["high"]] for name, spec in space.items()}
    for k in range(max(len(v) for v in values.values())):
        try:
            print_config([*fit_args, *param_flags({n: v[min(k, len(v) - 1)] for n, v in values.items()})], cli_main)
        except ConfigError:
            for name, value in ((name, value) for name, v in values.items() for value in v):
                try:
                    print_config([*fit_args, *param_flags({name: value})], cli_main)
                except ConfigError as error:
                    raise ConfigError(f"sweep.space.{name}: the fit does not accept {value!r}: {error}") from None
            raise
    return config


def open_study(sweep: dict, storage: str, study_dir: Path, sampler, *, create: bool) -> optuna.Study:
    """The study in its storage, created by the first worker; ConfigError when the storage cannot be opened, or
    holds a study of that name that optimizes another way."""
    name, made = sweep["study"], []
    if "://" not in storage:
        journal = Path(storage)
        if not create and not journal.is_file():
            raise ConfigError(f"no study {name!r} yet: {journal} does not exist; start it with python -m project sweep "
                              "--config <sweep file>")
        if sweep["storage"] is None and create:
            made = [p for p in (study_dir, *study_dir.parents) if not p.exists()]
            study_dir.mkdir(parents=True, exist_ok=True)
        elif not journal.parent.is_dir():
            raise ConfigError(f"sweep.storage {storage}: its folder {journal.parent} does not exist; create it, or "
                              "give an RDB URL (sqlite:///sweep.db)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        opened = open_storage(storage)
        study = (optuna.create_study(study_name=name, storage=opened, sampler=sampler, direction=sweep["direction"],
                                     load_if_exists=True) if create
                 else optuna.load_study(study_name=name, storage=opened, sampler=sampler))
    except KeyError:
        raise ConfigError(f"no study {name!r} in {storage}; start it with python -m project sweep --config "
                          "<sweep file>") from None
    except Exception as error:  # noqa: BLE001  sqlalchemy's, OSError, ...: the storage cannot be used at all
        for directory in made:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise ConfigError(f"sweep.storage {storage} cannot be opened ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:200]}); give a journal file on a filesystem every worker "
                          "sees, or an RDB URL (sqlite:///sweep.db, postgresql://user@host/db)") from None
    wanted = (study.direction.name.lower(), study.user_attrs.get("metric", sweep["metric"]))
    if wanted != (sweep["direction"], sweep["metric"]):
        raise ConfigError(f"study {name!r} in {storage} was created to {' '.join(wanted)}, this sweep would "
                          f"{sweep['direction']} {sweep['metric']}: name another study (--sweep.study=NAME)")
    if create and "metric" not in study.user_attrs:
        study.set_user_attr("metric", sweep["metric"])
    return study


# -- the summary -----------------------------------------------------------------------------------------------------
def summarize(study: optuna.Study, study_dir: Path, sweep: dict) -> str:
    """Write trials.csv and the plots into the study dir; the lines to print, the best trial's on the last one."""
    import csv

    from project.engine.run.checkpoint_io import atomic_write

    trials = study.get_trials(deepcopy=False)
    names = list(dict.fromkeys([*sweep["space"], *(p for t in trials for p in t.params)]))
    rows = [["number", "state", "value", "run_dir", "retry_of", "checkpoint", "worker", "seconds", *names]]
    for t in trials:
        ended = t.datetime_complete and t.datetime_start
        value = t.user_attrs.get(BEST, t.value) if t.state.name in ("COMPLETE", "PRUNED") else ""  # best validation
        attrs = [t.user_attrs.get(RUN_DIR, ""), t.system_attrs.get("failed_trial", ""),
                 t.user_attrs.get(CHECKPOINT, ""), t.user_attrs.get(WORKER, "")]
        rows.append([t.number, t.state.name, value, *attrs,
                     f"{(t.datetime_complete - t.datetime_start).total_seconds():.1f}" if ended else "",
                     *(t.params.get(n, "") for n in names)])
    atomic_write(study_dir / "trials.csv", lambda f: csv.writer(f).writerows(rows), mode="w", fsync=False)
    plots = write_plots(study, study_dir, atomic_write, sweep["metric"])
    states = [t.state.name for t in trials]
    lines = [f"sweep {study.study_name}: {states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
             f"{states.count('FAIL')} failed, {states.count('RUNNING')} running (n_trials {sweep['n_trials']}); "
             f"{study_dir / 'trials.csv'}" + "".join(f", {p.name}" for p in plots)]
    if "COMPLETE" not in states:
        return "\n".join([*lines, f"sweep {study.study_name}: no complete trial yet"])
    best = study.best_trial
    checkpoint = best.user_attrs.get(CHECKPOINT) or "(none)"
    return "\n".join([*lines, f"best trial {best.number}: {sweep['metric']} {best.value:.4f} with "
                      f"{' '.join(param_flags(best.params))}; checkpoint {checkpoint}"])


def write_plots(study: optuna.Study, study_dir: Path, atomic_write, metric: str) -> list[Path]:
    """Optimisation history, parameter importances and parallel coordinates as PNGs (those the trials allow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    complete = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    written = []
    for name, plot, needs in (("optimization_history", plots.plot_optimization_history, 1),
                              ("param_importances", plots.plot_param_importances, 2),
                              ("parallel_coordinate", plots.plot_parallel_coordinate, 1)):
        if complete < needs:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an experimental API
                axes = plot(study, target_name=metric)
            axes = axes.flat[0] if hasattr(axes, "flat") else axes
            figure = axes.figure
            figure.set_size_inches(11, 6)
            if name == "parallel_coordinate":
                legible_parallel_coordinates(axes, [*study.best_trial.params])
            figure.tight_layout()
            written.append(atomic_write(study_dir / f"{name}.png", lambda f, figure=figure: figure.savefig(
                f, format="png", dpi=100), fsync=False))
            plt.close(figure)
        except (ImportError, ValueError, RuntimeError, ZeroDivisionError, IndexError):  # importances: scikit-learn
            continue
    return written


def legible_parallel_coordinates(axes, names: list[str]) -> None:
    """Optuna's plot draws low values white on grey ("Blues") and cuts long names (`model.optim.lr_pe...`): every
    line in a colour map without a white end, and the whole names, broken at their last dot."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.colors import ListedColormap

    dark = ListedColormap(colormaps["viridis"](np.linspace(0.0, 0.85, 256)))  # its pale yellow end cut off
    for lines in (c for c in axes.collections if isinstance(c, LineCollection)):
        lines.set(cmap=dark, linewidth=2.5, clip_on=False)  # the best and worst values run along the plot's edges
    labels = []
    for tick in axes.get_xticklabels():
        text = tick.get_text()
        full = next((n for n in names if text.endswith("...") and n.startswith(text[:-3])), text)
        labels.append(full[::-1].replace(".", "\n.", 1)[::-1] if "." in full else full)
    axes.set_xticks(axes.get_xticks(), labels, rotation=0, fontsize=9)
