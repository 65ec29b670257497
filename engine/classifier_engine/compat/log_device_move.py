"""`self.log` in training steps without Lightning's no-op move of a metric to the device it is already on."""

import lightning as L
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric


class _SameDeviceMetric(_ResultMetric):
    def to(self, *args, **kwargs) -> _ResultMetric:
        # A tensor metric's tensors all sit where `value` is: the stock `to` moves them together, and update and reset
        # make new ones beside `value`. So `value` on the device means the stock `to` would move nothing.
        device = args[0] if len(args) == 1 and not kwargs else None
        if self.is_tensor and isinstance(device, torch.device) and self.value.device == device:
            return self
        return super().to(*args, **kwargs)


class _SameDeviceResults(_ResultCollection):
    def __setitem__(self, key: str, metric: _ResultMetric) -> None:
        if type(metric) is _ResultMetric:  # made by _ResultCollection.log for a name logged the first time
            metric.__class__ = _SameDeviceMetric
        super().__setitem__(key, metric)


def skip_same_device_moves(trainer: L.Trainer, skip: bool = True) -> bool:
    """Make this Trainer's training-step `self.log` skip the no-op move (skip=False: move again, as stock Lightning
    does; bench/overhead.py --lightning-log-move). The one private access here. True if this call changed anything."""
    results = trainer.fit_loop.epoch_loop._results
    wanted = _SameDeviceResults if skip else _ResultCollection
    if type(results) not in (_ResultCollection, _SameDeviceResults) or type(results) is wanted:
        return False  # done already, or not the class this was written against
    results.__class__ = wanted
    for metric in results.values():  # names logged by an earlier fit of this Trainer
        metric.__class__ = _SameDeviceMetric if skip else _ResultMetric
    return True
