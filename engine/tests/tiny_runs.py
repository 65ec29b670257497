"""What both suites (the library's, engine/tests, and a template's, tests/) use to run the real CLI on tiny data: a
learnable image folder, the flags that shrink a real config to a quick CPU run, a callback flag, TensorBoard's scalars,
a small real disk (the tmpfs fixture).

    from tiny_runs import SHRINK, write_image_folder      # engine/tests on sys.path (a template's conftest puts it)
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Shrinks a real config (the quickstart's) for tests: no progress bars or summaries, one quick epoch.
SHRINK = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.max_epochs=1",
    "--trainer.log_every_n_steps=1",
    "--data.batch_size=8",
]


def write_image_folder(root: Path, classes: dict[str, tuple[int, int]], *, size: int = 32, seed: int = 0) -> Path:
    """Write root/{train,val}/<class>/*.jpg: noisy images whose mean colour depends on the class (learnable)."""
    rng = np.random.default_rng(seed)
    palette = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (40, 200, 200)]
    for index, (name, (n_train, n_val)) in enumerate(sorted(classes.items())):
        colour = np.array(palette[index % len(palette)], dtype=np.int16)
        for split, count in (("train", n_train), ("val", n_val)):
            out = root / split / name
            out.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                noise = rng.integers(-40, 40, size=(size, size, 3))
                pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(out / f"{name}_{i:03d}.jpg", quality=90)
    return root


def callback(class_path: str, **init_args) -> str:
    """A `--trainer.callbacks+=` argument adding one callback."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a TensorBoard run dir, read with tensorboard's own reader: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size (a real, small disk, and another filesystem than /tmp); needs root."""
    mounts = []

    def mount(size: str) -> Path:
        target = tmp_path / f"tmpfs{len(mounts)}"
        target.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                                capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)
