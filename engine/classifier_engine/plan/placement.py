"""The run plan's passes on where a run lives: the run root (an object store's mirror), the checkpoint it continues
from, its trackers and its run dir. They read the filesystem and the store, never write: claiming is the start's.

    python -m classifier_engine fit --config CONFIG --ckpt_path last --plan
"""

import re
from pathlib import Path
from typing import Optional

from classifier_engine.errors import ConfigError
from classifier_engine.run.remote_runs import RemoteRoot
from classifier_engine.run.resume import Choice, Where, choose_checkpoint, furthest, logger_pins, looks_for_checkpoints
from classifier_engine.run.run_dirs import logger_version
from classifier_engine.run.tracked_runs import tracked_runs_to_continue, tracker_edits
from classifier_engine.run.trackers import check_trackers, hidden_credentials, kind_of, logger_entries
from classifier_engine.run_plan import CHECKPOINT, RUN_DIR, TRACKERS, Decision, PlanInput


def run_root(given: PlanInput) -> list[Decision]:
    """An s3:// trainer.default_root_dir: the run works in its node-local mirror (dry: the store is listed, not
    touched)."""
    root = given.config.trainer.get("default_root_dir")
    if not (isinstance(root, str) and re.match(r"s3:|s3//", root, re.IGNORECASE)):  # (a mistyped URL: refused)
        return []
    remote = given.reads["remote"] = RemoteRoot(root)
    remote.client()  # boto3 is an extra: its absence is one line here, before the store is asked anything
    if given.dry:
        given.reads["stored"] = remote.listing()
    return [Decision("run root", {"url": remote.url, "mirror": str(remote.mirror)},
                     "an object store: the run works in a node-local mirror and uploads each checkpoint as it is saved "
                     "($CLASSIFIER_ENGINE_RUN_MIRROR, else runs/ in the library's cache)",
                     edits=(("trainer.default_root_dir", str(remote.mirror)),))]


def checkpoint(given: PlanInput) -> list[Decision]:
    """The checkpoint to continue from, loaded once (later stations take it from the plan's reads), and why."""
    requested, remote = given.config.get("ckpt_path"), given.reads.get("remote")
    if isinstance(requested, str) and re.match(r"s3:|s3//", requested, re.IGNORECASE) and requested[:5] != "s3://":
        raise ConfigError(f"--ckpt_path {requested} looks like a mistyped object-store URL: write s3://bucket/key.ckpt "
                          "(lowercase s3, a colon, two slashes)")
    if isinstance(requested, str) and requested.startswith("s3://"):  # a stored run's checkpoint, read in the mirror
        if remote is None or not f"{requested.rstrip('/')}/".startswith(f"{remote.url}/"):
            raise ConfigError(f"--ckpt_path {requested}: a stored checkpoint is read through the run root it is under: "
                              "pass --trainer.default_root_dir s3://bucket/prefix of its run (or download it first)")
        if (name := remote.named(requested)) is None or not name.endswith(".ckpt"):
            raise ConfigError(f"--ckpt_path {requested}: names no checkpoint file of the run root; pass a stored .ckpt "
                              f"(e.g. {remote.url}/lightning_logs/version_0/checkpoints/last.ckpt)")
        requested = str(remote.mirror / name)
    where = given.reads["where"] = Where.of(given.subcommand, given.config)
    stored = _stored_choice(given, requested)
    if stored is not None:
        return [stored]
    choice = choose_checkpoint(given.subcommand, requested, where, given.reads.get("fetch_checkpoints"))
    given.reads["choice"], given.reads["checkpoint"] = choice, choice.checkpoint
    if choice.path is None:
        why = choice.reason or "no --ckpt_path: a new run"
        return [Decision(CHECKPOINT, None, why, edits=(("ckpt_path", None),) if requested else ())]
    state = choice.checkpoint
    value = {"path": str(choice.path), "step": int(state["global_step"]), "epoch": int(state["epoch"])}
    return [Decision(CHECKPOINT, value, choice.reason, text=f"{choice.path} (epoch {value['epoch']}, step "
                     f"{value['step']})", edits=(("ckpt_path", str(choice.path)),))]


def _stored_choice(given: PlanInput, requested: Optional[str]) -> Optional[Decision]:
    """Dry, in an object store: the stored checkpoint a start would likely continue from, by its upload record (a
    start reads the checkpoints' own records, a requeue only its run dir's; the mirror may hold one further along)."""
    remote, stored = given.reads.get("remote"), given.reads.get("stored")
    if remote is None or stored is None:
        return None
    if not looks_for_checkpoints(given.subcommand, requested):  # one given: the stored object, if the mirror lacks it
        if (name := remote.named(requested)) is None or not remote.outdated(name, stored):
            return None
        if name not in stored:
            raise remote.not_stored(name)
        given.reads["choice"] = Choice(Path(requested), None, "stored")
        return Decision(CHECKPOINT, {"path": requested, "url": f"{remote.url}/{name}"}, "--ckpt_path: a stored "
                        "checkpoint, which a start downloads into the mirror", text=f"{remote.url}/{name}",
                        edits=(("ckpt_path", requested),))
    claims = {remote.mirror / name: claim or (0.0,) * 4
              for name, claim in remote.claims(stored, given.reads["logs_name"]).items()}
    if (path := furthest(claims)) is None:
        return None
    name = remote.name(path)
    value = {"path": str(path), "url": f"{remote.url}/{name}", "step": int(claims[path][1])}
    given.reads["choice"] = Choice(Path(value["path"]), None, "stored")
    return Decision(CHECKPOINT, value, "--ckpt_path last: the stored checkpoint furthest along by its upload record; "
                    "a start chooses by their own records (a Slurm requeue: in its own run dir)",
                    text=f"{value['url']} (step {value['step']})", edits=(("ckpt_path", value["path"]),))


def credentials(given: PlanInput) -> list[Decision]:
    """fit: a password in a tracking URI moved out of the config (into MLflow's own variables), before anything
    prints, saves or sends the URI."""
    edits, dropped = hidden_credentials(given.config.trainer)
    decisions = []
    if dropped:
        decisions.append(Decision("tracking credentials dropped", dropped, "an earlier start in this process moved "
                                  "them into MLFLOW_TRACKING_USERNAME and _PASSWORD for that server; this one "
                                  "tracks at others only"))
    if edits:
        decisions.append(Decision("tracking credentials", "moved into MLFLOW_TRACKING_USERNAME and _PASSWORD",
                                  "a tracking URI held a password", edits=tuple(edits)))
    return decisions


def trackers(given: PlanInput) -> list[Decision]:
    """fit: the trackers checked (a missing package, a server that does not answer: one line), the tracked runs a
    resume continues."""
    trainer = given.config.trainer
    check_trackers(trainer)
    place = given.reads.get("place")
    ids = tracked_runs_to_continue(trainer, place.run_dir) if place and not place.new and place.run_dir else {}
    given.reads["tracked"] = ids
    kinds = [kind_of(entry) for _, entry in logger_entries(trainer)] or (
        ["tensorboard"] if trainer.get("logger") in (None, True) else [])
    continued = {kind: ids[kind] for kind in ("mlflow", "wandb") if ids.get(kind)}
    why = f"continuing the run dir's tracked runs ({', '.join(f'{k} {v}' for k, v in continued.items())})" \
        if continued else "trainer.logger"
    return [Decision(TRACKERS, kinds, why, text=", ".join(kinds) or "none")]


def run_dir(given: PlanInput) -> list[Decision]:
    """Where the run's files go: a fit's run dir (claimed, or proposed when dry), an evaluation's own version dir;
    the file loggers pinned to it, the trackers pointed at it."""
    trainer, path, place = given.config.trainer, given.reads.get("run_dir"), given.reads.get("place")
    if path is None:
        return []
    path, where, fit = Path(path), given.reads["where"], given.subcommand == "fit"
    edits = tracker_edits(trainer, path, given.reads.get("tracked") or {}) if fit else []
    if not fit or where.given_dir is None:
        edits += logger_pins(trainer, where.root, logger_version(path.name))
    if fit:
        why = place.why if place is not None else "the run dir"
    else:
        why = "an evaluation logs into a version dir of its own, never into a training run's"
    value = {"path": str(path), "new": bool(place.new) if place is not None else True}
    return [Decision(RUN_DIR, value, why, text=f"{path}, {'new' if value['new'] else 'resumed'}",
                     edits=tuple(edits))]


def evaluation_logs(trainer) -> bool:
    """Whether an evaluation gets a version dir of its own: it logs (the default logger, or a file logger)."""
    return trainer.get("logger") is not False and (
        trainer.get("logger") in (None, True) or any(kind_of(e) in ("tensorboard", "csv")
                                                     for _, e in logger_entries(trainer)))
