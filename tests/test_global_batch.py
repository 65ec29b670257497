"""A global batch on the room's ResNet: its BatchNorm layers normalise over each process's share, which is said once.
(The global batch itself, on any model: engine/tests/test_global_batch.py.)

    python -m pytest tests/test_global_batch.py
"""

import pytest

from conftest import cli_main, tiny_args


def test_per_device_batchnorm_under_a_global_batch_is_said_once(tiny_root, tmp_path, caplog):
    with pytest.warns(UserWarning, match="BatchNorm layers normalise over each process's 4 images") as warned:
        cli_main(["fit", *tiny_args(tiny_root, tmp_path, "--global_batch_size=8", "--data.batch_size=4")])
    assert sum("BatchNorm" in str(w.message) for w in warned) == 1
