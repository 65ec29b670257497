"""tools/preprocess.py gives the project's evaluation pixels exactly and runs an export without this package.

    python -m pytest tests/test_preprocess.py
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from classifier_engine.data.decoders import image_loader
from classifier_engine.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_preset
from classifier_engine.export import export_network
from PIL import Image
from torchvision import models

from conftest import REPO

TOOL = REPO / "tools" / "preprocess.py"
# (width, height): landscape and portrait photos, thin strips, a square smaller than the crop, one already at size.
SIZES = [(640, 427), (427, 640), (33, 97), (97, 33), (500, 20), (224, 224), (256, 300), (1, 1)]
PRESETS = [(256, 224), (232, 224), (36, 32)]  # (resize, crop): ImageNet's, torchvision's v2 recipe's, the tests'


def load_tool():
    """tools/preprocess.py loaded from its file, as a user who copied it would."""
    spec = importlib.util.spec_from_file_location("preprocess_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour regions plus sensor-like noise: resampling differences show at every pixel."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    return Image.fromarray(np.clip(smooth + rng.integers(-20, 21, smooth.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list:
    """Real files of odd sizes: JPEG and PNG, and gray, palette and RGBA images (converted to RGB on reading)."""
    folder = tmp_path_factory.mktemp("odd_sizes")
    files = []
    for seed, (width, height) in enumerate(SIZES):
        image = photo(width, height, seed)
        files += [folder / f"{width}x{height}.jpg", folder / f"{width}x{height}.png"]
        image.save(files[-2], quality=90)
        image.save(files[-1])
    image = photo(640, 427, 99)
    for mode in ("L", "P", "RGBA"):
        files.append(folder / f"640x427_{mode}.png")
        image.convert(mode).save(files[-1])
    return files


@pytest.mark.parametrize("resize, crop", PRESETS)
def test_preprocess_gives_the_eval_presets_pixels_exactly_on_images_of_odd_sizes(image_files, resize, crop):
    tool = load_tool()
    preset = eval_preset(resize_size=resize, crop_size=crop)
    preset_uint8 = eval_preset(resize_size=resize, crop_size=crop, normalize=False)  # what the workers hand the GPU
    decode = image_loader("auto")  # data.decoder's default: what training evaluated with
    for path in image_files:
        image = tool.load_rgb(path)
        assert torch.equal(image, decode(path)), f"{path.name}: the tool reads other pixels than the data module"
        crop_uint8 = tool.resize_and_crop(image, resize=resize, crop=crop)
        assert crop_uint8.dtype == torch.uint8 and torch.equal(crop_uint8, preset_uint8(image)), path.name
        floats = tool.preprocess(image, resize=resize, crop=crop, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        assert floats.shape == (3, crop, crop) and torch.equal(floats, preset(image)), path.name
        with Image.open(path) as pil:  # a PIL image in, as eval_preset also accepts
            assert torch.equal(tool.preprocess(pil, resize=resize, crop=crop, mean=IMAGENET_MEAN, std=IMAGENET_STD),
                               floats), path.name


def test_preprocess_refuses_what_is_not_a_uint8_rgb_image():
    tool = load_tool()
    with pytest.raises(ValueError,
                       match=r"expected a 3 x H x W uint8 RGB tensor, got torch.float32 of shape \(3, 8, 8\)"):
        tool.preprocess(torch.rand(3, 8, 8), resize=8, crop=8, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def test_a_missing_export_or_image_is_one_line_exit_2(tmp_path, capsys):
    tool = load_tool()
    network = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3)).eval()
    export_network(network, tmp_path / "export", example=torch.randn(2, 3, 8, 8), class_names=["a", "b", "c"],
                   preprocessing={"resize": 8, "crop": 8, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
                   onnx=False)
    for argv, said in (([tmp_path / "nowhere", tmp_path / "a.jpg"], f"{tmp_path / 'nowhere'}: no model.json there: "
                        "pass the folder `python -m project export` wrote (RUN/export)"),
                       ([tmp_path / "export", tmp_path / "a.jpg"], f"{tmp_path / 'a.jpg'}: not an image Pillow "
                        "reads (No such file or directory)")):
        assert tool.main(list(map(str, argv))) == 2
        assert capsys.readouterr().err.strip() == f"error: {said}"


@pytest.mark.slow  # another process
def test_the_copied_file_runs_an_export_without_this_package_or_lightning(tmp_path):
    torch.manual_seed(0)
    network = models.resnet18(num_classes=3)
    with torch.no_grad():
        network.train()(torch.randn(8, 3, 32, 32) * 2 + 1)  # non-trivial BatchNorm statistics: eval mode matters
    network.eval()
    names, pre = ["cat", "dog", "fox"], {"resize": 36, "crop": 32, "mean": list(IMAGENET_MEAN),
                                         "std": list(IMAGENET_STD)}
    export_network(network, tmp_path / "export", example=torch.randn(2, 3, 32, 32), class_names=names,
                   preprocessing=pre, onnx=False)
    photos = [tmp_path / "wide.jpg", tmp_path / "tall.png"]
    photo(61, 45, 0).save(photos[0], quality=90)
    photo(45, 61, 1).save(photos[1])
    shutil.copy(TOOL, tmp_path / "export" / "preprocess.py")  # next to the model, as the README says

    # Any import of the project or of Lightning fails in that process.
    blocked = ("import runpy, sys; sys.modules['project'] = sys.modules['lightning'] = None; "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", blocked, "export/preprocess.py", "export", *map(str, photos)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = [dict(re.findall(r"^  (\w+): ([0-9.]+)$", block, flags=re.M))
               for block in re.split(r"^\S.*$", result.stdout, flags=re.M)[1:]]

    # The project's own evaluation transform and the eager network give the same classes and probabilities.
    preset = eval_preset(resize_size=pre["resize"], crop_size=pre["crop"])
    with torch.no_grad():
        probs = network(torch.stack([preset(image_loader("auto")(path)) for path in photos])).softmax(dim=1)
    assert printed == [{name: f"{p:.3f}" for name, p in zip(names, row)} for row in probs.tolist()]
    assert [line for line in result.stdout.splitlines() if not line.startswith("  ")] == list(map(str, photos))
