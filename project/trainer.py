"""Trainer: Lightning's own, with the batch limits typed so that an integer from YAML or the command line stays one.

Lightning annotates limit_{train,val,test,predict}_batches as Union[float, int]. The CLI's parser tries the types in
order, so `--trainer.limit_val_batches=1` (or `limit_val_batches: 1` in YAML) arrived as 1.0, which Lightning reads
as "100 % of the batches" instead of "one batch". Same arguments here with int first: 1 is one batch, 1.0 or 0.25
a fraction, as Lightning documents them.
"""

from typing import Optional, Union

import lightning as L

BatchLimit = Optional[Union[int, float]]


class Trainer(L.Trainer):
    def __init__(
        self,
        *,
        limit_train_batches: BatchLimit = None,
        limit_val_batches: BatchLimit = None,
        limit_test_batches: BatchLimit = None,
        limit_predict_batches: BatchLimit = None,
        **kwargs,
    ):
        limits = dict(
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches,
        )
        # Unset ones are left out, so Lightning's PL_TRAINER_* environment defaults still apply to them.
        super().__init__(**{name: value for name, value in limits.items() if value is not None}, **kwargs)
