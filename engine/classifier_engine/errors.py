"""Errors a person can read: one line (what, where, the fix), no traceback, exit 2 (docs/reliability.md#bad-input);
`CLASSIFIER_ENGINE_DEBUG=1 python -m <package> fit ...` shows the traceback too."""

import argparse
import contextlib
import errno
import glob
import os
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path
from stat import S_ISREG
from typing import Callable, Optional

import yaml

_STARTED = time.time()  # notes left by ranks of an earlier job are older than this process
EXIT_USER_ERROR = 2


def env_global_rank() -> int:
    """This process's global rank as its launcher set it (torchrun, Slurm, Lightning); 0 when started by hand."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    # Inside `srun --pty bash` Lightning's own children inherit SLURM_PROCID=0: only a Slurm *training* step counts.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and SLURMEnvironment.detect():
        return int(env["SLURM_PROCID"])
    local, node = int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", env.get("GROUP_RANK", 0)))
    return local if node == 0 else node * max(1, int(env.get("LOCAL_WORLD_SIZE", 1))) + local


def shown(path: os.PathLike | str) -> str:
    """A path for messages: a name that is not UTF-8 gets \\x.. escapes instead of breaking the line."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


class UserError(Exception):
    """A mistake in the user's input; its message says what, where, and the fix (and `saved`, where the fit it ended
    saved last.ckpt first)."""

    saved: Optional[str] = None


class ConfigError(UserError, ValueError):
    """A value in the config or on the command line that cannot work; a ValueError too, for Python callers."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder the run needs does not exist."""


class LauncherError(UserError, RuntimeError):
    """The launcher (torchrun, srun) started the run in a way the Trainer cannot use."""


class CheckpointError(UserError):
    """A checkpoint that does not exist, does not load, is not trusted, or does not fit the model or the data."""


class RunDirInUse(UserError):
    """Another live process writes into the run dir this one would write into."""


class DiskFullError(UserError):
    """A write found no space left (ENOSPC, EDQUOT); the file it would have replaced is intact."""


class DataUnavailable(UserError):
    """A data source (an object store) that kept failing after bounded retries; `saved` says where the run was saved."""


class UnreadableImageError(OSError):
    """A file no decoder can read (truncated, corrupt, not an image); an OSError, as PIL's are, for their handlers."""


# Messages of torch.distributed when a *peer* died or stopped answering: this rank is a victim, not the culprit.
_PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "NCCL communicator was aborted", "has exited", "recvBytes", "Socket Timeout", "Timed out waiting",
                 "Application timeout caused pair closure",  # gloo when the peer is stopped (SIGSTOP)
                 "waiting for clients")  # the rendezvous: a rank that never started (or not within the timeout)


def user_message(error: BaseException) -> Optional[str]:
    """The one-line message for an error the user caused, or None for a bug (which keeps its traceback)."""
    if isinstance(error, (UserError, UnreadableImageError)):
        saved = getattr(error, "saved", None)  # last.ckpt saved first (LastCheckpoint.keep_the_step)
        return (raised_in_worker(error) or str(error)) + (f"; {saved}" if saved else "")
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) and isinstance(
            error.__context__, UserError):  # the full disk that stopped the run failed a logger's finalize in
        return user_message(error.__context__)  # Lightning's clean-up too (compat: "a fit that fails calls each ...")
    if type(error).__name__ == "MisconfigurationException":  # Lightning's word for a setting that cannot work
        text = " ".join(str(error).split())
        no_gpu = re.search(r"No supported gpu backend found|(GPU|CUDA)Accelerator` can not run", text)
        return text + ("; this machine has no GPU torch can use: run on the CPU with --trainer.accelerator=cpu (or "
                       "auto)" if no_gpu else "")
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl+C) before training started; nothing was trained"
    if isinstance(error, argparse.ArgumentError):  # jsonargparse: an unknown option, a value of the wrong type
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m <a template's package, or ours>
        package = spec.name.partition(".")[0] if spec else "classifier_engine"
        text = readable_parse_error(str(error))[:600]
        hint = "; a folder to predict is --predictions.images DIR" if "predict_root" in text else ""
        return f"{text}{hint} (`python -m {package} <subcommand> --help` lists each option)"
    if isinstance(error, pickle.UnpicklingError):
        return untrusted_checkpoint_message(error)
    cause = error.__cause__
    while cause is not None and not isinstance(cause, UserError):  # jsonargparse wraps what a nested class raised
        cause = cause.__cause__
    return None if cause is None else str(cause)


def raised_in_worker(error: BaseException) -> Optional[str]:
    """The message of an error a DataLoader worker raised: torch raises it again in the main process as `Caught X in
    DataLoader worker process N` followed by the worker's traceback, whose last line is `module.X: message`."""
    text = str(error)
    if not re.match(r"Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback", text):
        return None
    return text.rpartition(f"{type(error).__module__}.{type(error).__qualname__}: ")[2].strip() or None


# Lines of jsonargparse's report on a value no alternative of a Union (Optional[...] included) accepts that say
# nothing about what was wrong: the subtypes, null, the value's type, a config-file path it is not.
_UNION_NOISE = re.compile(r"(?:- )?(?:Does not validate against any of the Union subtypes|Subtypes: .*|Errors:|"
                          r"Given value type: .*|Expected a <class 'NoneType'>|"
                          r"Expected a path but .* either not accessible or invalid)")


def readable_parse_error(text: str) -> str:
    """A jsonargparse parse error on one line: the key, what was expected, the value given (Union reports cut)."""
    union = "Does not validate against any of the Union subtypes" in text
    given, kept = None, []
    for line in (line.strip() for line in text.splitlines()):
        if union and line.startswith("Given value: "):
            given = line[len("Given value: "):]
        elif line and not (union and _UNION_NOISE.fullmatch(line)):
            kept.append(line)
    text = " ".join(" ".join(kept).split())
    if union:  # the alternatives left, each a "- " line
        text = re.sub(r"(:|^) - ", r"\1 ", text).replace(" - ", "; or ")
    # A field of a nested class (a dataclass option): one dotted key.
    text = re.sub(r'Parser key "([\w.]+)": Problem with given class_path \'[\w.]+\': Parser key "(\w+)":',
                  r'Parser key "\1.\2":', text)
    text = re.sub(r'Parser key "([\w.]+)":( Not of type \w+:)?', r"\1:", text)
    # A class given by class_path (the model, the data): its key and the option's, as one dotted key.
    nested = re.fullmatch(r"NestedArg\(key='[\w.]+', val='?(.*?)'?\)", given or "")
    text = re.sub(r"([\w.]+): Problem with given class_path '[\w.]+': Option '([\w.]+)' is not accepted",
                  lambda m: f"unrecognized arguments: --{m[1]}.{m[2]}" + (f"={nested[1]}" if nested else ""), text)
    text = re.sub(r"([\w.]+): Problem with given class_path '[\w.]+': ([\w.]+):", r"\1.\2:", text)
    text = re.sub(r"Expected an? <class '([\w.]+)'>", r"expected \1", text)
    text = re.sub(r"Expected an? typing\.Literal\[(.*?)\]", r"expected one of \1", text)
    text = text.replace(". Got value: ", ", got ")
    if nested and "got " not in text and "unrecognized" not in text:
        given = nested[1]
    if given is not None and "got " not in text and given not in text and not given.startswith(("{", "NestedArg")):
        text += f", got {given}"
    return text


def untrusted_checkpoint_message(error: BaseException, path: object = None) -> Optional[str]:
    """The one line (load_checkpoint's and user_message's) for torch.load(weights_only=True) refusing pickles."""
    text = str(error)
    if not (isinstance(error, pickle.UnpicklingError) and re.search("Weights only load failed|WeightsUnpickler", text)):
        return None
    found = re.search(r"Unsupported (global|operand)[^.\n]*", text)
    what = f" ({found.group(0).strip()})" if found else ""
    subject = f"{path} is not a trusted checkpoint" if path is not None else "refused to load an untrusted checkpoint"
    return (f"{subject}: it holds pickled objects beyond tensors and plain values{what}, which could run code; "
            "checkpoints are only loaded with torch.load(weights_only=True)")


def is_peer_failure(error: BaseException) -> bool:
    """True when `error` is a collective that broke because another rank died or hung (a consequence, not a cause)."""
    text = f"{type(error).__name__}: {error}"
    return "DistBackendError" in text or any(marker in text for marker in _PEER_FAILURE)


_rank: Optional[tuple[int, int]] = None  # (global rank, world size) once the Trainer knows them


def record_rank(global_rank: Optional[int], world_size: int = 1) -> None:
    """Remember this process's rank for the error line (None: forget, a new run starts)."""
    global _rank
    _rank = None if global_rank is None else (global_rank, world_size)


def rank_label() -> str:
    """' (rank N)' when this process is one of several ranks, else ''."""
    launched = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", 1)))  # 1 before Lightning's
    rank, world = _rank if _rank is not None else (env_global_rank(), launched)
    return f" (rank {rank})" if world > 1 else ""


def exit_on_user_error(run: Callable[[], object]) -> None:
    """Run a command's entry point: a user error ends it in one line and exit 2, a peer failure in one line and exit 1,
    a bug with its traceback. Under ddp the culprit also leaves its line in a note the others print last."""
    try:
        run()
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001  what is not the user's is raised again
        import torch.distributed as dist

        if debugging():
            raise  # the traceback
        if (message := user_message(error)) is not None:
            line = f"error{rank_label()}: {message}"
            print(line, file=sys.stderr, flush=True)
            if rank_label():  # the others print the line last, and fail their pending collectives now, not at timeout
                if (prefix := _note_prefix()) is not None:
                    with contextlib.suppress(OSError):  # the line was printed already; the note only repeats it
                        _write_new(f"{prefix}{os.getpid()}", line + "\n")
                    _remove_stale_notes()
                if dist.is_available() and dist.is_initialized():
                    with contextlib.suppress(Exception):  # closing a broken group may fail too
                        dist.destroy_process_group()
            sys.exit(130 if isinstance(error, KeyboardInterrupt) else EXIT_USER_ERROR)
        if not is_peer_failure(error):
            raise
        reason = " ".join(str(error).split("] ", 1)[-1].split())[:160]
        print(f"stopped{rank_label()}: another rank failed or stopped answering ({type(error).__name__}: {reason}); "
              "a failing rank prints its own error", file=sys.stderr, flush=True)
        for culprit in _notes_of_failed_ranks():
            print(culprit, file=sys.stderr, flush=True)
        sys.exit(1)


def debugging() -> bool:
    """$CLASSIFIER_ENGINE_DEBUG set (its name before 0.2, $PROJECT_DEBUG, is read too, with a note, until 0.3)."""
    value = os.environ.get("CLASSIFIER_ENGINE_DEBUG")
    if value is None and os.environ.get("PROJECT_DEBUG") is not None:
        print("note: $PROJECT_DEBUG is read as $CLASSIFIER_ENGINE_DEBUG (its new name) until classifier-engine 0.3",
              file=sys.stderr)
        value = os.environ["PROJECT_DEBUG"]
    return (value or "0") not in ("0", "false", "False")


def install_extra(extra: str) -> str:
    """How to install one of the library's extras, from a clone of the template and from the package index."""
    return f'pip install -e "./engine[{extra}]" (from a clone), or pip install "classifier-engine[{extra}]"'


def _note_prefix() -> Optional[str]:
    """Notes of one job share MASTER_ADDR:MASTER_PORT (set for every rank by torchrun, srun and Lightning)."""
    if not (port := os.environ.get("MASTER_PORT")):
        return None
    host = os.environ.get("MASTER_ADDR", "").replace("/", "_")
    return os.path.join(tempfile.gettempdir(), f"classifier-engine-error-{host}-{port}-")


def _write_new(path: str, text: str) -> None:
    """Write a new file only this user reads, never through a link or into a file someone else put there (the temp
    folder is everyone's: a link planted at the name would have the line overwrite the file it points to)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an earlier note of ours with this pid and port (or a link: removed, not followed)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as note:
        note.write(text)


def _remove_stale_notes(age_s: float = 86400) -> None:
    """This user's notes of jobs a day gone (their ranks read them within seconds), so that failed jobs do not pile
    notes up in the temp folder; another user's files, and anything not a plain file, are left as they are."""
    for note in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), "classifier-engine-error-*")):
        with contextlib.suppress(OSError):
            stat = os.lstat(note)
            if S_ISREG(stat.st_mode) and stat.st_uid == os.getuid() and stat.st_mtime < time.time() - age_s:
                os.unlink(note)


def _notes_of_failed_ranks(wait_s: float = 2.0) -> list[str]:
    """The error lines other ranks of this job left (waiting briefly for one that is still being written)."""
    if (prefix := _note_prefix()) is None:
        return []
    deadline = time.monotonic() + wait_s
    while True:
        notes = [n for n in glob.glob(glob.escape(prefix) + "*") if os.path.getmtime(n) >= _STARTED]  # this job's
        if notes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    lines = []
    for note in sorted(notes):
        with contextlib.suppress(OSError):
            lines.append(Path(note).read_text().strip())
    return [line for line in lines if line]


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB of YAML
MAX_CONFIG_VALUES = 100_000  # once its aliases are expanded (jsonargparse copies them out): a 1 KB alias bomb is 10^9


def config_files(argv: list[str]) -> list[str]:
    """The files of argv's `--config FILE` (or `-c`, `--config=FILE`)."""
    files = [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--config=", "-c="))]
    return files + [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--config", "-c")]


def check_config_files(argv: list[str]) -> None:
    """Every `--config FILE` loads (load_config_file), before the CLI parses any."""
    for name in config_files(argv):
        load_config_file(name)


def load_config_file(name: str | os.PathLike) -> object:
    """A config file's YAML; else a ConfigError naming the file: missing, over 1 MB, aliases expanding to over 100,000
    values (either would exhaust memory), nested too deeply, or a syntax error at its line and column."""
    path = os.path.expanduser(name)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {name} does not exist (--config takes a YAML file: "
                          "a run's config.yaml, or the options printed by --print_config)")
    check_config_text(f"config file {name}", os.path.getsize(path))
    try:
        text = Path(path).read_text()
        check_config_text(f"config file {name}", 0, text)
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"config file {name} is nested too deeply to be a config; fix the file") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {name}: YAML syntax error{where}: {problem}; fix the file") from None


def check_config_text(what: str, size: int, text: str = "") -> None:
    """ConfigError for a config whose parse would exhaust memory: over 1 MB, or aliases expanding to 100,001 values."""
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} is {size / 1e6:.1f} MB: a config is a few KB of YAML (at most "
                          f"{MAX_CONFIG_BYTES / 1e6:.1f} MB); is it the right file?")
    if "*" in text and _expanded_size(yaml.compose(text, Loader=yaml.SafeLoader), {}) > MAX_CONFIG_VALUES:
        raise ConfigError(f"{what}: its YAML aliases (*name) expand to over {MAX_CONFIG_VALUES:,} values (an alias "
                          "bomb?); write the values out")


def limited_yaml_mode() -> str:
    """The CLI's parser mode: jsonargparse's YAML, each text checked first (load_limited_yaml)."""
    from jsonargparse import set_loader

    set_loader("yaml_limited", load_limited_yaml, exceptions=(yaml.YAMLError,))
    return "yaml_limited"


def load_limited_yaml(text: str) -> object:
    """jsonargparse's YAML loader for every text the CLI parses: a --config file, a file one names (`config: x.yaml`,
    `trainer: x.yaml`, `--data x.yaml`), a value; ConfigError, naming the file, before an over-large one is parsed."""
    from jsonargparse import get_loader

    try:  # the files jsonargparse is reading, to name them (private, seen in 4.53: its stack for its loop check)
        from jsonargparse._util import config_load_stack

        files = [str(shown) for _, shown in config_load_stack.get()]
    except (ImportError, AttributeError, TypeError, ValueError):
        files = []
    what = (f"config file {files[-1]}" + (f" (named in {files[-2]})" if len(files) > 1 else "")) if files else \
        "a YAML value on the command line"
    try:
        check_config_text(what, len(text.encode()), text)
        return get_loader("yaml")(text)
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply to be a config; fix the file") from None


def _expanded_size(node: Optional[yaml.Node], sizes: dict[int, int]) -> int:
    """Values in the tree a composed YAML graph stands for: an alias is its anchor's node again, counted each time."""
    if node is not None and id(node) not in sizes:
        sizes[id(node)] = MAX_CONFIG_VALUES + 1  # met again while counting it: an alias inside its own anchor
        children = [n for child in node.value for n in (child if isinstance(child, tuple) else (child,))] \
            if isinstance(node.value, list) else []
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes.get(id(node), 0)
