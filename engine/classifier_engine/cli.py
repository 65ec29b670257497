"""LightningCLI over any LightningModule and LightningDataModule, with the run's safety rails; read top to bottom, the
sequence of a start: parse, plan (plan/), build with what the run adds (additions.py), check, run, say where it went.

    python -m classifier_engine fit --model.class_path my_models.MyModule --data.class_path my_data.MyData --plan
    python -m classifier_engine validate --config RUN/config.yaml --ckpt_path RUN/checkpoints/last.ckpt
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from classifier_engine.additions import EngineParser, add_run_arguments, additions
from classifier_engine.callbacks.prediction_writer import folder_loader
from classifier_engine.compat.batch_limits import Trainer
from classifier_engine.compat.ckpt_hparams import explicit_values
from classifier_engine.compat.upstream_noise import quiet_upstream_noise, resumed_run_dir
from classifier_engine.errors import ConfigError, limited_yaml_mode, record_rank
from classifier_engine.plan.make import make_plan
from classifier_engine.plan.started import Started
from classifier_engine.run.last_checkpoint import stops_reach_spawned_ranks
from classifier_engine.run.saved_config import KeepingSaveConfigCallback
from classifier_engine.run_plan import FINISHED, Pass
from classifier_engine.summary import where_the_run_went


@dataclass(frozen=True)
class Defaults:
    """What a config that names no class builds, and the entry point's own passes of the run plan (a template's:
    `(PlanInput) -> list[Decision]`, run after the engine's settings and checkpoint passes)."""

    model: Optional[type] = None
    data: Optional[type] = None
    passes: Sequence[Pass] = ()


LIMITED_YAML = limited_yaml_mode()  # on import: a ddp_spawn child unpickles the parser, never runs cli_main
PRINT_FLAGS = {"skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset",
               "comments": "with_comments"}


class EngineCLI(LightningCLI):
    """Defined in the package (not __main__) so ddp_spawn can pickle it."""

    started: Optional[Started] = None

    def __init__(self, *args, defaults: Defaults = Defaults(), **kwargs) -> None:
        # LightningCLI runs the whole command in __init__: what the start claimed is released (or, after a failed
        # start, removed) here.
        self.defaults = defaults
        error = None
        try:
            super().__init__(*args, **kwargs)
        except BaseException as raised:
            error = raised
            raise
        finally:
            if self.started is not None:
                self.started.close(error, getattr(self, "trainer", None))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        add_run_arguments(parser, self.defaults.model, self.defaults.data)

    # -- the one parse of the command line (and the one without defaults), then the run plan ---------------------
    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        given = list(sys.argv[1:] if args is None else args) if not isinstance(args, (dict, Namespace)) else None
        # --print_config prints after the plan's settings (what will be built); --plan prints the plan: both exit.
        printing = [word.partition("=")[2] for word in given or () if word.split("=")[0] == "--print_config"]
        dry = "--plan" in (given or ())
        words = None if given is None else [w for w in given if w != "--plan" and w.split("=")[0] != "--print_config"]
        # (LightningCLI's own parse_arguments, without its warning about args beside sys.argv: `words` are sys.argv's,
        # or the list given: [] is a command line without arguments)
        self.config = parser.parse_object(args) if given is None else parser.parse_args(words)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        explicit = explicit_values(parser, words if given is not None else args, self.config, subcommand)
        self.started = make_plan(
            subcommand, config, explicit, argv=words, passes=self.defaults.passes, dry=dry,
            printing=bool(printing), default_classes={"model": self.defaults.model, "data": self.defaults.data},
            parse_model=lambda model: self.parser.parse_object({subcommand: {"model": model}}, self.config)[
                subcommand].model)  # (the checkpoint's values are read only with a subcommand)
        if printing:
            self._print_config(subcommand, printing[-1])
        plan = self.started.plan
        if dry:
            print("\n".join([f"plan of {subcommand} (dry: nothing was built, written or downloaded):",
                             *(f"  {line}" for line in plan.lines(edits=True))]), flush=True)
            sys.exit(0)
        if plan.value(FINISHED):  # a complete run: its plan says so and which option continues it (the whole output,
            # printed as --plan's is: no logger is set up for a run that never starts)
            rank_zero_only(print)("\n".join([f"plan of this {subcommand}:", *(f"  {line}" for line in plan.lines())]),
                                  flush=True)
            sys.exit(0)
        if subcommand:
            self.save_config_kwargs = {**self.save_config_kwargs, "run_dir": self.started.run_dir}
            rank_zero_info("\n".join([f"plan of this {subcommand} (--plan shows it with the config keys it sets):",
                                      *(f"  {line}" for line in plan.lines())]))

    def _print_config(self, subcommand: Optional[str], flags: str) -> None:
        options = {"skip_unset": False, "skip_validation": False}
        for flag in filter(None, flags.split(",")):
            if flag not in PRINT_FLAGS:
                raise ConfigError(f"--print_config={flags}: {flag!r} is not one of {', '.join(PRINT_FLAGS)}")
            options[PRINT_FLAGS[flag]] = True
        parser = self._parser(subcommand)  # LightningCLI's own subcommand parser (its one accessor)
        sys.stdout.write(parser.dump(self.config[subcommand] if subcommand else self.config, **options))
        sys.exit(0)

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's read of --ckpt_path's hyperparameters is the plan's (plan/settings.py, from its one load)."""

    # -- build: the classes, then the Trainer with what the run adds -------------------------------------------
    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        init = self.config_init[self.subcommand] if self.subcommand else self.config_init
        config = self.config[self.subcommand] if self.subcommand else self.config
        self.added = additions(init["trainer"], init, config, self.started.plan, self.datamodule, self.started.remote)
        for part, replaced in (("trainer", self.added.trainer), (None, self.added.groups)):
            for key, value in replaced.items():  # into the instantiated config (the parsed one is the plan's)
                (init[part] if part else init)[key] = value
        trainer = super().instantiate_trainer(**kwargs)
        trainer.run_plan = self.started.plan  # what later stations read (the samplers' global batch, plan.yaml)
        for patch in self.added.patches:
            patch(trainer)
        return trainer

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        self.started.take_over(self.trainer, self.model, self.datamodule, self.added.checkpoint_io)

    # -- run, and say where it went ------------------------------------------------------------------------------
    def fit(self, model, datamodule=None, **kwargs) -> None:
        # ddp_spawn: this process only waits for the ranks; a resume's own checkpoint folder is not "not empty"
        with stops_reach_spawned_ranks(self.trainer), resumed_run_dir(not self.started.plan.fresh):
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
        remote = self.started.remote
        stored = f" (stored in {remote.url_of(self.started.run_dir)})" if remote and self.started.run_dir else ""
        rank_zero_info(where_the_run_went(self.trainer, self.started.run_dir) + stored)

    def predict(self, model, datamodule=None, **kwargs):
        """A data module without a predict set of its own predicts the folder --predictions.images."""
        if (loader := folder_loader(self.trainer, model, datamodule)) is not None:
            return self.trainer.predict(model, dataloaders=loader, **kwargs)
        return self.trainer.predict(model, datamodule=datamodule, **kwargs)


def cli_main(args: Optional[list[str]] = None, *, model: Optional[type] = None, data: Optional[type] = None,
             passes: Sequence[Pass] = (), run: bool = True) -> EngineCLI:
    """LightningCLI over any LightningModule and LightningDataModule; `model` and `data` are the classes a config that
    names none builds, `passes` the entry point's own passes of the run plan (a template's). Tests call it
    in-process with a list of arguments."""
    record_rank(None)  # this run's Trainer records its own (a process may build several: notebooks, tests)
    quiet_upstream_noise(debugging=True)  # (in-process callers keep Python's warning format; main() makes it one line)
    return EngineCLI(
        L.LightningModule, L.LightningDataModule, args=args, run=run, parser_class=EngineParser,
        defaults=Defaults(model, data, tuple(passes)),
        subclass_mode_model=True, subclass_mode_data=True,  # any module by class_path; the entry point's are defaults
        trainer_class=Trainer,  # Lightning's, with `limit_*_batches: 1` meaning one batch (classifier_engine/compat)
        seed_everything_default=42,  # fixed, so a resumed or requeued job continues the same data order
        auto_configure_optimizers=False,  # the model's configure_optimizers scales the LR: no --optimizer override
        save_config_callback=KeepingSaveConfigCallback,
        save_config_kwargs={"overwrite": True},  # a resumed run writes its config; the previous one is kept
        # Parse errors raise (main() prints them as one line) instead of printing the whole usage and exiting; every
        # YAML text read (nested config files too) is size- and alias-checked first.
        parser_kwargs={"prog": f"python -m {entry_module(model)}", "exit_on_error": False,
                       "parser_mode": LIMITED_YAML,
                       **{sub: {"exit_on_error": False} for sub in ("fit", "validate", "test", "predict")}},
    )


def entry_module(model: Optional[type] = None) -> str:
    """What `python -m` runs, for usage lines: the default model's package (a template's), else the library."""
    return model.__module__.partition(".")[0] if model is not None else "classifier_engine"
