"""Optuna sweeps: a sweep file is a fit config with a `sweep:` section (Sweep below); how it runs: docs/sweeps.md.

    python -m classifier_engine sweep --config SWEEP.yaml  # a worker; start more to share it
    python -m classifier_engine sweep --summary --config SWEEP.yaml  # trials.csv, plots, the best
    python -m classifier_engine sweep --help  # fit options, then the sweep's
"""

import argparse
import contextlib
import csv
import difflib
import math
import pydoc
import re
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import optuna
import yaml
from jsonargparse import ArgumentParser, Namespace, capture_parser
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt

from classifier_engine.compat.ckpt_hparams import explicit_values
from classifier_engine.compat.subclass_nulls import restored_nulls
from classifier_engine.config_edits import apply_edits
from classifier_engine.contract import monitor_options
from classifier_engine.errors import ConfigError, check_config_files, readable_parse_error
from classifier_engine.options import refuse_others_options
from classifier_engine.run.sweep_trials import BEST, CHECKPOINT, RUN_DIR, Worker, int_range, open_storage, param_flags
from classifier_engine.run.trackers import check_trackers, hidden_credentials, redact
from classifier_engine.run_plan import Decision, RunPlan
from classifier_engine.storage.files import atomic_write


@dataclass
class Sweep:
    """The `sweep:` section of a sweep file (or --sweep.KEY=VALUE): what to search, and how workers share the study.

    Args:
        study: the study's name and folder under <default_root_dir>/sweeps/ (default: the sweep file's name)
        storage: <study dir>/journal.log by default; another journal file, or an RDB URL (sqlite:///x.db)
        direction: maximize or minimize (default: minimize a loss, maximize the rest)
        metric: what a trial is scored on, its best over its validations: a metric the model logs (default: the
            fit's checkpoint.monitor, the model's contract Monitor)
        n_trials: the study's number of trials, shared by all its workers
        sampler: an Optuna sampler, e.g. {class_path: TPESampler, init_args: {...}} (default: TPESampler)
        pruner: an Optuna pruner, e.g. {class_path: MedianPruner, init_args: {...}} (default: MedianPruner)
        space: fit options by dotted name: {low: 0.01, high: 1.0, log: true} (step: ...) or {choices: [...]}
        configs: fit config files the sweep builds on, applied first (every --config and flag goes over them)
        heartbeat_interval: seconds between a worker's heartbeats on its trial
        grace_period: a running trial silent this long is failed and retried from its last.ckpt
        max_retry: retries of a trial whose worker died or was preempted; then it stays failed
        launcher: prefix of each trial's command, e.g. "srun --kill-on-bad-exit=1" (under sbatch)
    """

    study: Optional[str] = None
    storage: Optional[str] = None
    direction: Optional[Literal["maximize", "minimize"]] = None
    metric: Optional[str] = None
    n_trials: PositiveInt = 20
    sampler: Optional[optuna.samplers.BaseSampler] = None
    pruner: Optional[optuna.pruners.BasePruner] = None
    space: dict[str, dict] = field(default_factory=dict)
    configs: list[str] = field(default_factory=list)
    heartbeat_interval: PositiveFloat = 30.0
    grace_period: PositiveFloat = 120.0
    max_retry: NonNegativeInt = 10
    launcher: Optional[str] = None


def main(argv: list[str], cli_main: Callable[..., Any]) -> None:
    """`python -m <package> sweep ARGV`: check everything, run this worker's share of the study, print the summary.
    `cli_main`: classifier_engine.cli's with the entry point's defaults (the run wing does not import the CLI)."""
    check_config_files(argv)
    refuse_others_options(argv, "sweep", "fit")  # (its trials are fits)
    dry, argv = "--plan" in argv, [arg for arg in argv if arg != "--plan"]
    # jsonargparse carries the init_args a new class_path accepts over from the previous class (a MedianPruner's
    # n_warmup_steps into a ThresholdPruner): a sampler or pruner on the command line is given whole.
    whole = ("--sweep.sampler", "--sweep.pruner")
    argv = [a for arg in argv for a in ([arg.split("=")[0] + "=null"] if arg.split("=")[0] in whole else []) + [arg]]
    parser = sweep_parser(cli_main)
    try:
        # The files the sweep builds on (sweep.configs) go first, under everything else. The parse that finds them is
        # not validated: a library entry has no default model or data until those files give them.
        given = [arg for arg in argv if not arg.startswith("--print_config")]  # printed with the configs in
        argv = [*(f"--config={path}" for path in parse(parser, given, validate=False).sweep.configs), *argv]
        check_config_files(argv)
        config = parse(parser, argv)
    except SystemExit as stop:  # --help, --print_config: printed, nothing to run
        if stop.code:
            raise
        return
    sweep, summary_only = config.pop("sweep"), config.pop("summary")
    # Else the chosen model class's Monitor (the parser's checkpoint.monitor default is the default class's).
    sweep.metric = sweep.metric or monitor_options(config.model.get("class_path")).get("checkpoint.monitor") or \
        config.checkpoint.monitor
    sampler = check_sweep(sweep, config.get("config") or [])
    check_fit_options(parser, argv, config, sweep.space)
    study_dir = Path(config.trainer.default_root_dir or ".") / "sweeps" / sweep.study
    storage = sweep.storage or str(study_dir / "journal.log")
    if dry:  # the study is not opened: a journal or database it would create stays uncreated
        print("\n".join(["plan of sweep (dry: no study opened, no trial run, nothing written):",
                         *(f"  {line}" for line in sweep_plan(sweep, study_dir, storage).lines())]), flush=True)
        return
    options = None if summary_only else trial_options(parser, argv, config)
    if not summary_only:  # (before the study is made: a trial that cannot track would fail, a trial slot used up)
        check_trackers(config.trainer)
    study = open_study(sweep, storage, study_dir, sampler, create=not summary_only)
    code = 0
    if options is not None:
        entry = parser.prog.removeprefix("python -m ").removesuffix(" sweep")  # trials: `python -m ENTRY fit`
        code = Worker(study, storage, study_dir, options, sweep, entry).run()
        if code == 2:  # a trial's bad input: its error stays the last line
            sys.exit(code)
    print(summarize(study, study_dir, sweep), flush=True)
    if code:
        sys.exit(code)


def trial_options(parser: ArgumentParser, argv: list[str], config: Namespace) -> str:
    """The fit options every trial starts from (YAML), each of which reaches the trial as given: a URI's password moved
    into the environment the trials inherit; the checkpoint's monitor, mode and file name the model class's, not the
    parser's defaults, as the fit's monitor pass decides them (all as set when the sweep sets checkpoint.monitor; else
    the model's, except a mode or file name the sweep sets)."""
    apply_edits(config, hidden_credentials(config.trainer)[0])
    explicit = explicit_values(parser, argv, config, None)
    if explicit.get("checkpoint.monitor") is None:
        apply_edits(config, [(key, value) for key, value in monitor_options(config.model.get("class_path")).items()
                             if explicit.get(key) is None])
    return parser.dump(config, skip_none=False)


def sweep_plan(sweep: Namespace, study_dir: Path, storage: str) -> RunPlan:
    """What a sweep worker would do (--plan): its study, where it is kept, what it scores and searches."""
    given = "sweep.storage" if sweep.storage else "the study dir's journal (workers on any node of a shared filesystem)"
    sampler, pruner = (spec.get("class_path") if spec else "Optuna's default" for spec in (sweep.sampler, sweep.pruner))
    return RunPlan("sweep", (
        Decision("study", sweep.study, "sweep.study, else the sweep file's name", text=f"{sweep.study} in {study_dir}"),
        Decision("storage", redact(storage), given),
        Decision("score", {"metric": sweep.metric, "direction": sweep.direction}, "sweep.metric and direction (a loss "
                 "is minimized, anything else maximized, unless given)"),
        Decision("trials", sweep.n_trials, "sweep.n_trials, shared by every worker of the study"),
        Decision("search", {"sampler": sampler, "pruner": pruner}, "sweep.sampler, sweep.pruner"),
        Decision("space", sweep.space, "sweep.space: fit options by dotted name", text="; ".join(
            f"{name} {spec}" for name, spec in sweep.space.items()))))


def sweep_parser(cli_main: Callable[..., Any]) -> ArgumentParser:
    """The fit's own parser (LightningCLI's, as `cli_main` builds it) with the `sweep:` settings and --summary."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LightningCLI: "args given in-process while sys.argv holds others"
        parser = capture_parser(lambda: cli_main([], run=False))
    parser.prog = f"{parser.prog} sweep"  # python -m <the template's package, or classifier_engine> sweep
    parser.description = "Hyperparameter sweeps (Optuna): the fit options every trial starts from, then the sweep's."
    parser.add_class_arguments(Sweep, "sweep")
    parser.add_argument("--summary", action="store_true", help="write trials.csv and the plots, print the best trial; "
                        "run no trial")
    return parser


def parse(parser: ArgumentParser, args: list[str], validate: bool = True) -> Namespace:
    """The command line as the parser reads it; a ConfigError (one line) for what it refuses."""
    try:
        config = parser.parse_args(args, _skip_validation=not validate)
    except argparse.ArgumentError as error:
        text = readable_parse_error(str(error))
        unknown = re.search(r"(?:arguments: --sweep\.|Group 'sweep' does not accept option ')([\w.]+)", text)
        setting, _, argument = unknown[1].partition(".") if unknown else ("", "", "")
        if setting in ("sampler", "pruner") and argument:  # (--sweep.sampler.x: an argument of the sampler's class)
            raise ConfigError(f"sweep.{setting}: its class takes no {argument.rpartition('.')[2]}; drop it, or give "
                              "an argument of the class's own signature") from None
        if unknown:
            raise ConfigError(f"sweep.{setting} is not a sweep setting; they are: "
                              f"{', '.join(f.name for f in fields(Sweep))}") from None
        text = re.sub(r"sweep\.(sampler|pruner): Expected a dot import path string: (\S+)",
                      r"sweep.\1: cannot build optuna.\1s.\2", text)
        where = "" if text.startswith("sweep.") else "fit options of the sweep: "
        raise ConfigError(f"{where}{text[:600]} (`{parser.prog} --help` lists them)") from None
    apply_edits(config, restored_nulls(config, args))
    return config


# -- the checks, before anything is written --------------------------------------------------------------------------
def check_sweep(sweep: Namespace, config_files: list) -> Optional[optuna.samplers.BaseSampler]:
    """Check the settings (ConfigError), fill in the study's name and direction; the sampler (None: Optuna's)."""
    sweep.space = flat(sweep.space)
    if not sweep.study:  # the last config file with a `sweep:` section names it
        named = [Path(str(p)).stem for p in config_files if "sweep" in (yaml.safe_load(Path(str(p)).read_text()) or {})]
        if not named:
            raise ConfigError("no sweep file: pass --config <name>.yaml (a YAML file with a `sweep:` section)")
        sweep.study = named[-1]
    if "/" in sweep.study or sweep.study.startswith("."):
        raise ConfigError(f"sweep.study {sweep.study!r}: expected a name (it is the study's folder under sweeps/)")
    if not sweep.metric:
        raise ConfigError("sweep.metric is not set and the model names no monitor: pass --sweep.metric NAME (a metric "
                          "the model logs at each validation)")
    sweep.direction = sweep.direction or ("minimize" if sweep.metric.endswith("loss") else "maximize")
    if sweep.heartbeat_interval >= sweep.grace_period:
        raise ConfigError(f"sweep.heartbeat_interval {sweep.heartbeat_interval}, grace_period {sweep.grace_period}: "
                          "the grace period must be longer than the interval (a few heartbeats)")
    if not sweep.space:
        raise ConfigError("sweep.space is empty: name fit options and their ranges, e.g. "
                          "`model.lr: {low: 0.01, high: 1.0, log: true}`")
    for name, spec in sweep.space.items():
        check_range(f"sweep.space.{name}", spec)
    if sweep.pruner is not None:  # each trial's fit builds its own from the spec
        sweep.pruner = build(sweep.pruner, "pruner") and sweep.pruner.as_dict()
    if sweep.sampler is None:
        return None
    if sweep.sampler.class_path == "optuna.samplers.GridSampler" and sweep.sampler.init_args.get("search_space"):
        grid = sweep.sampler.init_args.search_space
        if set(grid) != set(sweep.space):
            raise ConfigError(f"sweep.sampler: the GridSampler's grid names {sorted(grid)}, sweep.space names "
                              f"{sorted(sweep.space)}: give the grid one list of values per entry of the space")
        grid.update({name: as_written(values, sweep.space[name]) for name, values in grid.items()})
        size = math.prod(len(values) for values in grid.values())
        if sweep.n_trials > size:  # then Optuna repeats points, and its stop() ends the worker with a traceback
            print(f"sweep: n_trials {sweep.n_trials} > the grid's {size} points: n_trials {size}", flush=True)
            sweep.n_trials = size
    return build(sweep.sampler, "sampler")


def as_written(values: list, spec: dict) -> list:
    """A grid's values as the space writes them: jsonargparse reads Optuna's grid values (float before int in their
    Union) as 32.0 for 32, which a choice of 32 hands to the fit as `32.0` (classifier_engine/compat)."""
    if "choices" in spec:
        return [next((c for c in spec["choices"] if c == v and isinstance(c, bool) == isinstance(v, bool)), v)
                for v in values]
    return [int(v) if int_range(spec) and isinstance(v, float) and v.is_integer() else v for v in values]


def build(spec: Namespace, what: str):
    """The Optuna sampler or pruner of a `{class_path, init_args}` the parser checked; a ConfigError if it refuses."""
    try:
        return pydoc.locate(spec.class_path)(**spec.get("init_args", Namespace()).as_dict())
    except (TypeError, ValueError) as error:
        raise ConfigError(f"sweep.{what}: {spec.class_path} refuses its arguments ({error})") from None


def flat(space: dict, prefix: str = "") -> dict:
    """The space by dotted names: `--sweep.space.model.lr=...` reaches it as {model: {lr...: ...}}."""
    entries = {}
    for key, spec in space.items():
        nested = isinstance(spec, dict) and spec and all(isinstance(value, dict) for value in spec.values())
        entries.update(flat(spec, f"{prefix}{key}.") if nested else {prefix + key: spec})
    return entries


def check_range(where: str, spec: dict) -> None:
    """One search-space entry: `{choices: [...]}`, or `{low, high}` with optional `log` and `step`."""
    if set(spec) == {"choices"} and isinstance(spec["choices"], list):
        if len(spec["choices"]) < 2:
            raise ConfigError(f"{where}: {len(spec['choices'])} choice(s) is an empty search; give two or more, or set "
                              "the option as an ordinary fit option")
        if any(c is not None and not isinstance(c, (bool, int, float, str)) for c in spec["choices"]):
            raise ConfigError(f"{where}: choices must be plain values (null, numbers, strings, booleans), got "
                              f"{spec['choices']!r}")
        return
    if not ({"low", "high"} <= set(spec) <= {"low", "high", "log", "step"}):
        raise ConfigError(f"{where}: expected {{low: ..., high: ...}} (and log, step) or {{choices: [...]}}, got "
                          f"{spec!r}")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high, step or 1)) \
            or (step is not None and step <= 0) or not isinstance(log, bool):
        raise ConfigError(f"{where}: expected numbers low and high, a positive step, log true or false; got {spec!r}")
    if low > high:
        raise ConfigError(f"{where}: inverted range, low {low} > high {high}; swap them")
    if low == high or (step is not None and high - low < step):
        raise ConfigError(f"{where}: empty range [{low}, {high}]" + (f" with step {step}" if step else "")
                          + "; widen it, or set the option as an ordinary fit option")
    if log and (low <= 0 or step is not None):  # Optuna refuses a step on a log scale (at the first trial)
        raise ConfigError(f"{where}: a log range needs low > 0 and no step, got low {low}, step {step}; drop step "
                          "or log")


def check_fit_options(parser: ArgumentParser, argv: list[str], config: Namespace, space: dict[str, dict]) -> None:
    """ConfigError for a fit option the sweep decides itself, or a space entry the fit does not take (its parser's)."""
    names = {key.replace("init_args.", ""): value for key, value in config.items(branches=True)}  # model.x: the class's
    if names.get("checkpoint.dirpath"):
        raise ConfigError("--checkpoint.dirpath cannot be given to a sweep: each trial's run dir decides it; leave "
                          "it out")
    limit = names.get("trainer.limit_val_batches")  # (an int counts batches: 1 is one; the float 1.0 is the split)
    if limit is not None and not (isinstance(limit, float) and limit == 1.0):
        raise ConfigError(f"trainer.limit_val_batches {names['trainer.limit_val_batches']}: trials would score on the "
                          "first batches of the validation split, other images for another data.batch_size; sweeps "
                          "score on the whole split: drop it (or make the split itself smaller)")
    for name in space:
        if name not in names:
            near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
            raise ConfigError(f"sweep.space.{name} is not a fit option{f' (did you mean {near[0]}?)' if near else ''};"
                              f" `{parser.prog.removesuffix(' sweep')} fit --print_config` lists them")
        if isinstance(names[name], Namespace):
            raise ConfigError(f"sweep.space.{name} is a group of options: sweep one of them, e.g. "
                              f"{name}.{next(iter(names[name].keys()))}")
    # Every value the space can give goes through the parser: the ends of the ranges and every choice, several at once.
    values = {name: spec.get("choices") or [spec["low"], spec["high"]] for name, spec in space.items()}
    for k in range(max(len(v) for v in values.values())):
        try:
            parse(parser, [*argv, *param_flags({n: v[min(k, len(v) - 1)] for n, v in values.items()})])
        except ConfigError:
            for name, value in ((name, value) for name, v in values.items() for value in v):
                try:
                    parse(parser, [*argv, *param_flags({name: value})])
                except ConfigError as error:
                    raise ConfigError(f"sweep.space.{name}: the fit does not accept {value!r}: {error}") from None
            raise


def open_study(sweep: Namespace, storage: str, study_dir: Path, sampler, *, create: bool) -> optuna.Study:
    """The study, made by the first worker; ConfigError if its storage cannot be opened or it optimizes another way."""
    name, made = sweep.study, []
    start = "start it with a worker (the sweep subcommand without --summary, --config <sweep file>)"
    journal = None if "://" in storage else Path(storage)
    if journal and not create and not journal.is_file():
        raise ConfigError(f"no study {name!r} yet: {journal} does not exist; {start}")
    if journal and sweep.storage and not journal.parent.is_dir():
        raise ConfigError(f"sweep.storage {storage}: its folder {journal.parent} does not exist; create it, or give an "
                          "RDB URL (sqlite:///sweep.db)")
    if create:  # the default journal's folder; the trials' run dirs and the summary's with any storage
        made = [p for p in (study_dir, *study_dir.parents) if not p.exists()]
        study_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        opened = open_storage(storage)
        study = (optuna.create_study(study_name=name, storage=opened, sampler=sampler, direction=sweep.direction,
                                     load_if_exists=True) if create
                 else optuna.load_study(study_name=name, storage=opened, sampler=sampler))
    except KeyError:
        raise ConfigError(f"no study {name!r} in {redact(storage)}; {start}") from None
    except Exception as error:  # noqa: BLE001  sqlalchemy's, OSError, ...: the storage cannot be used at all
        for directory in made:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise ConfigError(f"sweep.storage {redact(storage)} cannot be opened ({type(error).__name__}: "
                          f"{redact(' '.join(str(error).split()))[:200]}); give a journal file on a filesystem every "
                          "worker sees, or an RDB URL (sqlite:///sweep.db, postgresql://user@host/db)") from None
    wanted = (study.direction.name.lower(), study.user_attrs.get("metric", sweep.metric))
    if wanted != (sweep.direction, sweep.metric):
        raise ConfigError(f"study {name!r} in {redact(storage)} was created to {' '.join(wanted)}, this sweep would "
                          f"{sweep.direction} {sweep.metric}: name another study (--sweep.study=NAME)")
    if create and "metric" not in study.user_attrs:
        study.set_user_attr("metric", sweep.metric)
    return study


# -- the summary -----------------------------------------------------------------------------------------------------
def summarize(study: optuna.Study, study_dir: Path, sweep: Namespace) -> str:
    """Write trials.csv and the plots into the study dir; the lines to print, the best trial's on the last one."""
    trials = study.get_trials(deepcopy=False)
    names = list(dict.fromkeys([*sweep.space, *(p for t in trials for p in t.params)]))
    rows = [["number", "state", "value", "seconds", "run_dir", "retry_of", "checkpoint", *names]]
    for t in trials:
        value = t.user_attrs.get(BEST, t.value) if t.state.name in ("COMPLETE", "PRUNED") else ""  # best validation
        rows.append([t.number, t.state.name, value, f"{t.duration.total_seconds():.1f}" if t.duration else "",
                     t.user_attrs.get(RUN_DIR, ""), t.system_attrs.get("failed_trial", ""),
                     t.user_attrs.get(CHECKPOINT, ""), *(t.params.get(n, "") for n in names)])
    atomic_write(study_dir / "trials.csv", lambda f: csv.writer(f).writerows(rows), mode="w", fsync=False)
    plots = write_plots(study, study_dir, sweep.metric)
    states = [t.state.name for t in trials]
    lines = [f"sweep {study.study_name}: {states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
             f"{states.count('FAIL')} failed, {states.count('RUNNING')} running (n_trials {sweep.n_trials}); "
             f"{study_dir / 'trials.csv'}" + "".join(f", {p.name}" for p in plots)]
    if "COMPLETE" not in states:
        return "\n".join([*lines, f"sweep {study.study_name}: no complete trial yet"])
    best = study.best_trial
    return "\n".join([*lines, f"best trial {best.number}: {sweep.metric} {best.value:.4f} with "
                      f"{' '.join(param_flags(best.params))}; checkpoint {best.user_attrs.get(CHECKPOINT) or '(none)'}"
                      ])


def write_plots(study: optuna.Study, study_dir: Path, metric: str) -> list[Path]:
    """Optimisation history, parameter importances and parallel coordinates as PNGs (those the trials allow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    complete, written = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))), []
    for name, needs in (("optimization_history", 1), ("param_importances", 2), ("parallel_coordinate", 1)):
        if complete < needs:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an experimental API
                axes = getattr(plots, f"plot_{name}")(study, target_name=metric)
            axes.figure.set_size_inches(11, 6)
            if name == "parallel_coordinate":
                legible_parallel_coordinates(axes, [*study.best_trial.params])
            axes.figure.tight_layout()
            written.append(atomic_write(study_dir / f"{name}.png", lambda f, figure=axes.figure: figure.savefig(
                f, format="png", dpi=100), fsync=False))
            plt.close(axes.figure)
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
    cut = [tick.get_text() for tick in axes.get_xticklabels()]
    whole = [next((n for n in names if text.endswith("...") and n.startswith(text[:-3])), text) for text in cut]
    axes.set_xticks(axes.get_xticks(), [".\n".join(name.rsplit(".", 1)) for name in whole], rotation=0, fontsize=9)
