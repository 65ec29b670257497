"""The run plan: every decision a start makes, each with its reason, made once before anything is built or written
(engine/docs/how-it-works.md#the-run-plan). Later stations read it (`trainer.run_plan`) instead of the config's keys.

    python -m classifier_engine fit --config CONFIG --plan      # print it and exit: nothing built, nothing written
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from jsonargparse import Namespace

PLAN_FILE = "plan.yaml"  # in the run dir: the plan of its latest start (a resume's says what changed)


@dataclass(frozen=True)
class Decision:
    """One decision: its topic, the value later stations read (plain data: it goes to plan.yaml), how it reads, why,
    and the config keys it set (dotted, in the subcommand's config; config_edits.py writes them)."""

    topic: str
    value: Any
    why: str = ""
    text: Optional[str] = None  # how the value reads, if not str(value)
    edits: tuple[tuple[str, Any], ...] = ()

    def line(self) -> str:
        shown = self.text if self.text is not None else _shown(self.value)
        return f"{self.topic}: {shown}" + (f" ({self.why})" if self.why else "")


def _plain(value: Any) -> Any:
    """A value as plain data (a namespace as a dict, a path as text): what plan.yaml holds."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, Mapping):
        return ", ".join(f"{key} {_shown(item)}" for key, item in value.items())
    return str(value)


@dataclass(frozen=True)
class RunPlan:
    """The decisions of one start, in the order they were made; `value(topic)` is what a later station reads."""

    subcommand: Optional[str]
    decisions: tuple[Decision, ...] = ()

    def value(self, topic: str, default: Any = None) -> Any:
        return next((d.value for d in reversed(self.decisions) if d.topic == topic), default)

    def with_decisions(self, decisions: Iterable[Decision]) -> "RunPlan":
        """This plan with `decisions` added; one of a topic already decided replaces it (a claim that found another
        version free, a checkpoint confirmed after its download)."""
        new = list(decisions)
        topics = {d.topic for d in new}
        kept = [d for d in self.decisions if d.topic not in topics]
        return dataclasses.replace(self, decisions=(*kept, *new))

    # What later stations read (the engine's own topics; a room's passes add their own).
    @property
    def world_size(self) -> int:
        return int(self.value(WORLD_SIZE, 1))

    @property
    def global_batch(self) -> Optional[int]:
        """--global_batch_size's N when it was given (the samplers then take N samples a step at any world size)."""
        batch = self.value(GLOBAL_BATCH) or {}
        return batch.get("global") if batch.get("fixed") else None

    @property
    def ckpt_path(self) -> Optional[str]:
        return (self.value(CHECKPOINT) or {}).get("path")

    @property
    def run_dir(self) -> Optional[str]:
        return (self.value(RUN_DIR) or {}).get("path")

    @property
    def fresh(self) -> bool:
        """A new run dir (not a resume into one that holds a run)."""
        return bool((self.value(RUN_DIR) or {}).get("new", True))

    def lines(self, edits: bool = False) -> list[str]:
        """One line a decision, with its reason; with `edits`, each followed by the config keys it set."""
        return [line for d in self.decisions for line in [d.line(), *([f"    sets {key} = {_plain(value)!r}" for
                                                                         key, value in d.edits] if edits else [])]]

    def as_dict(self) -> dict[str, Any]:
        """plan.yaml's content: each decision's value, reason and edits, by topic (plain values: it names no code)."""
        return {"subcommand": self.subcommand,
                "decisions": {d.topic: {"line": d.line(), "value": _plain(d.value), "why": d.why,
                                        **({"sets": {key: _plain(value) for key, value in d.edits}} if d.edits else {})}
                              for d in self.decisions}}

    def changes(self, stored: Any) -> list[str]:
        """What differs from a stored plan (its as_dict, read back: untrusted, values only), one entry a topic."""
        before = stored.get("decisions") if isinstance(stored, dict) else None
        if not isinstance(before, dict):
            return []
        changed = []
        for decision in self.decisions:
            then = before.get(decision.topic)
            then = then.get("value") if isinstance(then, dict) else None
            if decision.topic in COMPARED and then is not None and then != decision.value:
                changed.append(f"{decision.topic} {_shown(then)} -> {_shown(decision.value)}")
        return changed


@dataclass(frozen=True)
class PlanInput:
    """What a pass reads: the subcommand's config as it stands (read-only: a pass returns edits), what the command line
    and its config files set explicitly, the decisions made so far, and whether this is a dry run (--plan: read, never
    write). A pass is `(PlanInput) -> list[Decision]`; a room's passes (cli_main(passes=...)) are the same."""

    subcommand: Optional[str]
    config: Namespace
    explicit: Namespace
    decided: RunPlan
    argv: Optional[Sequence[str]] = None  # the command line as given (None: settings from Python)
    dry: bool = False
    default_classes: Mapping[str, Optional[type]] = field(default_factory=dict)  # the entry point's model and data
    # the checkpoint hyperparameters' parse into the model's section (the CLI's parser); None outside the CLI
    parse_model: Optional[Callable[[dict], Namespace]] = None
    reads: dict = field(default_factory=dict)  # what passes read and later stations reuse (a loaded checkpoint)


Pass = Callable[[PlanInput], Sequence[Decision]]

# The engine's topics (the passes in plan/ make them).
CLASSES, MONITOR, SEED, WORLD_SIZE, STRATEGY, PRECISION = "classes", "monitor", "seed", "world size", "strategy", \
    "precision"
GLOBAL_BATCH, CHECKPOINT, RUN_DIR, TRACKERS, STEPS = "global batch", "checkpoint", "run dir", "trackers", \
    "steps per epoch"
FINISHED = "finished"  # a fit whose checkpoint trained all it asks for: the start ends after its plan
# What a resume compares with the run's stored plan (the rest, a checkpoint's path or a run dir, moves by design).
COMPARED = (CLASSES, SEED, WORLD_SIZE, STRATEGY, PRECISION, GLOBAL_BATCH, MONITOR)
