"""A LightningModule written from scratch against the contract (not a subclass of a template's): what this suite
trains (configs/quickstart.yaml here), and what test_contract.py copies into a
temporary folder as a user's own file. It imports only Lightning, torch, torchmetrics and the library's public API."""
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from classifier_engine import Monitor


class TinyNet(L.LightningModule):
    metric = "val/accuracy"
    monitor = Monitor(metric, "max")

    def __init__(self, num_classes: int, width: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        layers = []
        for inputs, outputs, stride in ((3, width, 1), (width, 2 * width, 2), (2 * width, 2 * width, 2)):
            layers += [nn.Conv2d(inputs, outputs, 3, stride, padding=1), nn.GroupNorm(4, outputs), nn.ReLU()]
        # A 4x4 grid, not one average: where the strokes are is what tells digits apart (0.88 after an epoch, 0.10 with
        # global pooling).
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * width, num_classes))
        self.accuracy = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images):
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.accuracy.update(self(images), labels)
        self.log(self.metric, self.accuracy)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def exportable(self):
        return self.net

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Unmonitored(TinyNet):
    monitor = None


class Top1Net(TinyNet):
    """What the suite trains (configs/quickstart.yaml here): the names a template's model logs
    (val/acc1, val/acc5, val/loss, test/...), which the tests read, and an LR schedule by step."""

    metric = "val/acc1"
    monitor = Monitor(metric, "max")

    def __init__(self, num_classes: int, width: int = 16, lr: float = 0.05):
        super().__init__(num_classes, width, lr)
        self.top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.loss = MeanMetric(nan_strategy="disable")  # every image of every rank; no host read per batch

    def validation_step(self, batch, batch_idx):
        self.log_dict(self.evaluate(*batch, "val"))

    def test_step(self, batch, batch_idx):
        self.log_dict(self.evaluate(*batch, "test"))

    def evaluate(self, images, labels, split: str) -> dict:
        """One forward for every metric of the batch; the metrics themselves, for Lightning to reduce over ranks."""
        logits = self(images)
        for metric in (self.accuracy, self.top5):
            metric.update(logits, labels)
        self.loss.update(F.cross_entropy(logits, labels, reduction="none"))
        return {f"{split}/acc1": self.accuracy, f"{split}/acc5": self.top5, f"{split}/loss": self.loss}

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}
