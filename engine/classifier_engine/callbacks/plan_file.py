"""plan.yaml in the run dir: the run plan of its latest start (a fit's with its steps per epoch, counted at train
start), written by global rank 0 once the run runs; a resume keeps the previous one as plan.<n>.yaml.

    python -m classifier_engine fit --config CONFIG      # then: cat <run dir>/plan.yaml
"""

import math
from pathlib import Path

import lightning as L
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from classifier_engine.run_plan import PLAN_FILE, STEPS, Decision, RunPlan
from classifier_engine.storage.files import atomic_write, keep_aside


class PlanFile(Callback):
    def __init__(self, plan: RunPlan):
        self.plan, self.written = plan, False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batches, accumulation = trainer.num_training_batches, trainer.accumulate_grad_batches
        if math.isfinite(batches):
            steps = Decision(STEPS, math.ceil(batches / accumulation), f"{batches} batches per process, "
                             f"{accumulation} accumulated")
            self.plan = self.plan.with_decisions([steps])
            trainer.run_plan = self.plan  # (the Trainer's attribute the CLI set: later stations read the plan there)
            rank_zero_info(steps.line())
        self._write(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.plan.subcommand != "fit":
            self._write(trainer)

    on_test_start = on_predict_start = on_validation_start

    def _write(self, trainer: L.Trainer) -> None:
        if self.written or not trainer.is_global_zero or self.plan.run_dir is None:
            return
        path = Path(self.plan.run_dir) / PLAN_FILE
        keep_aside(path)  # a previous start's, as plan.<n>.yaml
        text = yaml.safe_dump(self.plan.as_dict(), sort_keys=False, width=120)
        atomic_write(path, lambda file: file.write(text), mode="w")
        self.written = True
