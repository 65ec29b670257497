"""How a start makes its run plan: the settings, the placement (the run root, the checkpoint, read once), the entry
point's own passes, then for a fit the trackers and the run dir, claimed (a lock; in an object store, a lease created
only where none is: a new version another node's start took at the same moment is left to it). Each pass reads the
config as the passes before it left it (docs/how-it-works.md#the-run-plan); config_edits.py alone writes their edits.
`--print_config` stops after the settings and the entry point's passes; `--plan` runs it all reading only (a run dir
proposed, not claimed; nothing downloaded).

    python -m classifier_engine fit --config CONFIG --plan
"""

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import yaml
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_warn

from classifier_engine.config_edits import apply_edits, read_only
from classifier_engine.errors import env_global_rank
from classifier_engine.plan import placement, settings
from classifier_engine.plan.started import Started
from classifier_engine.run.lock import claim, claim_new_version
from classifier_engine.run.remote_lease import VersionTaken
from classifier_engine.run.resume import Choice, Place, Where, choose_place, looks_for_checkpoints, proposed
from classifier_engine.run.run_dirs import LOGS, version_of
from classifier_engine.run.trackers import credentials_put_back
from classifier_engine.run_plan import FINISHED, PLAN_FILE, Decision, Pass, PlanInput, RunPlan


class Planner:
    """Runs passes: each reads a read-only copy of the config, its decisions' edits are applied before the next."""

    def __init__(self, subcommand: Optional[str], config: Namespace, explicit: Namespace, **given: Any):
        self.subcommand, self.config, self.explicit, self.given = subcommand, config, explicit, given
        self.plan, self.reads = RunPlan(subcommand), {}

    def run(self, passes: Sequence[Pass]) -> None:
        for one in passes:
            decisions = one(PlanInput(self.subcommand, read_only(self.config), self.explicit, self.plan,
                                      reads=self.reads, **self.given))
            for decision in decisions:
                apply_edits(self.config, decision.edits)
            self.plan = self.plan.with_decisions(decisions)


def make_plan(subcommand: Optional[str], config: Namespace, explicit: Namespace, *,
              argv: Optional[Sequence[str]] = None, passes: Sequence[Pass] = (),
              default_classes: Mapping[str, Optional[type]] = {}, dry: bool = False, printing: bool = False,
              parse_model: Optional[Callable[[dict], Namespace]] = None) -> Started:
    """The plan of one start, its edits applied to `config` (the subcommand's); unless dry, carried out by rank 0
    (the others rely on its claims). The caller ends it: Started.close()."""
    planner = Planner(subcommand, config, explicit, argv=argv, dry=dry, default_classes=default_classes,
                      parse_model=parse_model)
    planner.run((settings.classes, settings.subcommand_options, settings.monitor, settings.seed, settings.world,
                 *((settings.batch,) if subcommand == "fit" else ())))
    if printing or subcommand is None:
        planner.run(passes)
        return Started(planner.plan, reads=planner.reads)
    with credentials_put_back() if dry else contextlib.nullcontext():
        return _placement(planner, (settings.checkpoint_model_values, settings.resumed_epoch, *passes), dry=dry,
                          claiming=not dry and env_global_rank() == 0)


def plan_run(subcommand: str, config: Namespace, *, claim_run_dir: bool = False) -> Started:
    """The placement stage alone (the checkpoint, the run dir), its edits applied to `config`: for a config that is
    only a `trainer` section and `ckpt_path` (tests, tools); `claim_run_dir` claims the run dir as a start does."""
    planner = Planner(subcommand, config, Namespace())  # (PlanInput's defaults: no command line, no classes)
    return _placement(planner, (), dry=False, claiming=claim_run_dir)


def _placement(planner: Planner, passes: Sequence[Pass], dry: bool, claiming: bool) -> Started:
    """The placement: the run root, the checkpoint, the given passes, then the run dir claimed (or proposed)."""
    subcommand, config = planner.subcommand, planner.config
    planner.run((placement.run_root,))
    remote, resume = planner.reads.get("remote"), looks_for_checkpoints(subcommand, config.get("ckpt_path"))
    # The store's folder of version dirs is the loggers' (under another logger name than lightning_logs: other runs)
    logs_name = remote.logs_name(Where.of(subcommand, config).logs) if remote is not None else LOGS
    planner.reads["logs_name"] = logs_name
    stored = remote.prepare(logs_name, resume) if remote is not None and not dry else None
    named = remote.named(config.get("ckpt_path")) if stored is not None else None  # one given (URL or mirror path)
    fetching = stored is not None and (resume or (named is not None and remote.outdated(named, stored)))
    if fetching:  # only the checkpoints the choice reads (a requeue: its own run dir's)
        planner.reads["fetch_checkpoints"] = functools.partial(remote.fetch_checkpoints, stored, logs_name)
    planner.run((placement.checkpoint, *passes, settings.finished))
    started = Started(planner.plan, planner.reads.get("checkpoint"), remote=remote, reads=planner.reads)
    if started.plan.value(FINISHED) and remote is None:
        return started  # nothing to train: no run dir to claim (in a store: claimed, so that close() sends what its
        # mirror holds and the store lacks, a save that could not be uploaded)
    if fetching and started.ckpt_path is not None:  # (an evaluation's too: export reads the config.yaml beside it)
        remote.fetch_run_dir(started.ckpt_path, stored)
    for path, why in started.skipped if not dry else ():
        rank_zero_warn(f"skipped checkpoint {path}: {why}")
    try:
        _place(planner, started, claiming)
    except BaseException:
        started.close(failed=True)
        raise
    return started


def _place(planner: Planner, started: Started, claiming: bool) -> None:
    """The run dir: a fit's (trackers checked first: a refused resume leaves its run dir as it was), or an
    evaluation's own version dir when it logs; claimed when `claiming`, else proposed."""
    reads, fit = planner.reads, planner.subcommand == "fit"
    where = reads["where"]
    if fit:
        place = reads["place"] = choose_place(reads.get("choice") or Choice(), where)
        planner.run((placement.credentials, placement.trackers))
    elif placement.evaluation_logs(planner.config.trainer):
        place = Place(None, True, "an evaluation's own version dir")
    else:
        return
    if claiming:
        while True:
            started.lock = claim(place.run_dir) if place.run_dir is not None else claim_new_version(where.logs)
            try:
                if started.remote is not None:  # (an evaluation's version dir too: two at once would share one)
                    started.remote.claim(started.lock.run_dir, new=place.run_dir is None)
                break
            except VersionTaken:  # another node's start created its lease first: that version is the other run's
                started.lock.remove_failed_start()
                started.lock.run_dir.mkdir(parents=True, exist_ok=True)  # so this node's next claim passes it
        reads["run_dir"] = started.lock.run_dir
    else:
        remote, stored = reads.get("remote"), reads.get("stored") or {}
        taken = [version_of(name) for name in remote.stored_versions(stored, reads["logs_name"])] if (
            remote is not None) else []
        reads["run_dir"] = proposed(place, where, tuple(n for n in taken if n is not None))
    planner.run((placement.run_dir, *((_changes,) if fit else ())))
    started.plan = planner.plan


def _changes(given: PlanInput) -> list[Decision]:
    """A resumed run dir's stored plan (read as values: it may come from a bucket) against this one."""
    stored = Path(given.reads["run_dir"]) / PLAN_FILE
    try:
        before = yaml.safe_load(stored.read_text()) if stored.is_file() else None
    except (OSError, yaml.YAMLError):
        before = None
    changed = given.decided.changes(before)
    return [Decision("changed since the last start", changed, f"{stored} against this start's")] if changed else []
