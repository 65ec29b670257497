"""Where the library keeps what it makes for itself (the embedded data set, shard caches, run mirrors).

    CLASSIFIER_ENGINE_CACHE=/local/nvme/cache python -m classifier_engine fit --config CONFIG
"""

import functools
import os
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

OLD_VARIABLE = "PROJECT_DATA_CACHE"  # its name before 0.2 (a template's word); read, with a note, until 0.3


@functools.cache
def _old_name_read() -> None:
    rank_zero_info(f"${OLD_VARIABLE} is read as $CLASSIFIER_ENGINE_CACHE (its new name) until classifier-engine 0.3")


def cache_dir() -> Path:
    """$CLASSIFIER_ENGINE_CACHE, by default ~/.cache/classifier-engine."""
    if "CLASSIFIER_ENGINE_CACHE" not in os.environ and OLD_VARIABLE in os.environ:
        _old_name_read()
        return Path(os.environ[OLD_VARIABLE]).expanduser()
    return Path(os.environ.get("CLASSIFIER_ENGINE_CACHE") or Path.home() / ".cache" / "classifier-engine").expanduser()
