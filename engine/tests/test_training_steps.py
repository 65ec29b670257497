"""classifier_engine.run.training_steps answers from public Trainer attributes what Lightning decides privately: which
batch ends follow an optimizer step, and on which of those it writes step metrics (none with log_every_n_steps=0). Each
answer is held against Lightning's own (`_logger_connector.should_update_logs`, `fit_loop._should_accumulate`) on a real
fit, with and without gradient accumulation and with a last, partial accumulation window."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from classifier_engine.run.training_steps import after_optimizer_step, is_logging_step


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Compare(L.Callback):
    def __init__(self):
        self.after = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = not trainer.fit_loop._should_accumulate()
        writes = stepped and trainer._logger_connector.should_update_logs  # what update_train_step_metrics does next
        self.after.append(((after_optimizer_step(trainer, batch_idx), is_logging_step(trainer, batch_idx)),
                           (stepped, writes)))


@pytest.mark.parametrize(("accumulate", "every"), [(1, 3), (2, 3), (1, 0)])
def test_step_predicates_agree_with_lightnings_own_decisions(tmp_path, accumulate, every):
    data = TensorDataset(torch.randn(26, 4), torch.randint(0, 2, (26,)))  # 13 batches: the last window is partial
    compare = Compare()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=every, accumulate_grad_batches=accumulate,
                        default_root_dir=tmp_path, callbacks=[compare], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, logger=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=2))

    assert len(compare.after) == 26
    assert [ours for ours, _ in compare.after] == [theirs for _, theirs in compare.after]
    logged = sum(writes for _, (_, writes) in compare.after)
    assert logged >= 2 if every else logged == 0  # the comparison saw logging steps, not only others
