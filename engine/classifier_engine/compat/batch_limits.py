"""Trainer with int-first batch limits: `--trainer.limit_val_batches=1` is one batch, not 1.0 (100 %)."""

from typing import Optional, Union

import lightning as L
from jsonargparse.typing import NonNegativeFloat

# Not Union[int, float]: typing caches unions by equality, and Lightning's signature already created the equal
# Union[float, int], which would bring the float-first order back. (jsonargparse's NonNegativeInt would not do
# either: it truncates 0.5 to 0.)
BatchLimit = Optional[Union[int, NonNegativeFloat]]


def _plain(limit: Optional[Union[int, float]]) -> Optional[Union[int, float]]:
    return limit if limit is None or isinstance(limit, int) else float(limit)


class Trainer(L.Trainer):
    def __init__(self, *, limit_train_batches: BatchLimit = None, limit_val_batches: BatchLimit = None,
                 limit_test_batches: BatchLimit = None, limit_predict_batches: BatchLimit = None,
                 overfit_batches: Union[int, NonNegativeFloat] = 0.0, **kwargs):
        super().__init__(limit_train_batches=_plain(limit_train_batches), limit_val_batches=_plain(limit_val_batches),
                         limit_test_batches=_plain(limit_test_batches),
                         limit_predict_batches=_plain(limit_predict_batches), overfit_batches=_plain(overfit_batches),
                         **kwargs)
