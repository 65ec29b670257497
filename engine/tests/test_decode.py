"""Every CPU decoder (nvimgcodec, torchcodec, torchvision, pil) turns ImageNet's quirky files (PNG named .JPEG, CMYK,
grayscale, 16-bit, animated, formats the tensor decoders lack) into 3-channel uint8 RGB; broken ones are named or
skipped; the decoder name is checked and "auto" falls back in a stated order, also when torchvision.io has no
decoders left.

    python -m pytest tests/test_decode.py
"""

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms.v2.functional import pil_to_tensor

from classifier_engine import ImageFolderDataModule
from classifier_engine.data.decoders import image_loader, main, resolve_decoder, unavailable
from classifier_engine.data.image_folders import DecodedImages, collate_readable
from classifier_engine.data.layout import folder_samples
from classifier_engine.errors import UnreadableImageError

HAS_TORCHCODEC = importlib.util.find_spec("torchcodec") is not None
HAS_NVIMGCODEC = unavailable("nvimgcodec") is None
NEEDS_TORCHCODEC = pytest.mark.skipif(not HAS_TORCHCODEC,
                                      reason='torchcodec is not installed: pip install -e "./engine[torchcodec]"')
NEEDS_NVIMGCODEC = pytest.mark.skipif(not HAS_NVIMGCODEC, reason=str(unavailable("nvimgcodec")))
TENSOR_DECODERS = [pytest.param("nvimgcodec", marks=NEEDS_NVIMGCODEC),
                   pytest.param("torchcodec", marks=NEEDS_TORCHCODEC), "torchvision"]
CPU_DECODERS = [*TENSOR_DECODERS, "pil"]
# How each decoder names itself, and what it says, in the reason of a file cut short (nvImageCodec says nothing).
CUT_SHORT = "Image is incomplete or truncated; PIL: "
LIBRARY = {"nvimgcodec": "nvImageCodec: cannot decode the bytes (corrupt, cut short, or a format it lacks); PIL: ",
           "torchcodec": f"torchcodec: {CUT_SHORT}", "torchvision": f"torchvision.io: {CUT_SHORT}", "pil": ""}

LEFT, RIGHT = (200, 30, 40), (20, 180, 220)  # flat halves: JPEG keeps flat colours within a few levels


def two_colour(height: int = 48, width: int = 64) -> np.ndarray:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2], pixels[:, width // 2 :] = LEFT, RIGHT
    return pixels


def as_rgb_array(image) -> np.ndarray:
    """(H, W, 3) uint8 from any decoder's output (PIL image or CHW tensor)."""
    return np.array(image) if isinstance(image, Image.Image) else image.permute(1, 2, 0).numpy()


def decode(decoder: str, path) -> np.ndarray:
    return as_rgb_array(image_loader(decoder)(str(path)))


@pytest.fixture(scope="module")
def quirky(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quirky")
    source = Image.fromarray(two_colour())
    source.save(folder / "png_named.JPEG", format="PNG")  # as n02105855_2933.JPEG in ImageNet's train set
    source.convert("CMYK").save(folder / "cmyk.JPEG", quality=95)  # Adobe-marked, inverted: Photoshop's CMYK
    source.convert("L").save(folder / "gray.JPEG", quality=95)
    source.save(folder / "bmp_named.JPEG", format="BMP")  # a format the tensor decoders do not read: PIL fallback
    source.save(folder / "plain.JPEG", quality=95)
    source.save(folder / "progressive.JPEG", quality=95, progressive=True)
    source.save(folder / "webp_named.JPEG", format="WEBP", lossless=True)
    (source.convert("RGBA")).save(folder / "rgba.png")  # an alpha channel to drop
    Image.fromarray(two_colour()[..., 0].astype(np.uint16) * 257).save(folder / "gray16.png")  # 16-bit gray
    frames = [Image.fromarray(two_colour()), Image.fromarray(two_colour()[:, ::-1].copy())]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    whole = (folder / "plain.JPEG").read_bytes()
    (folder / "truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    (folder / "not_an_image.JPEG").write_bytes(b"<html>403 Forbidden</html>")
    (folder / "empty.JPEG").write_bytes(b"")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    source.save(folder / "exif_rotated.JPEG", quality=95, exif=exif)
    return folder


@pytest.mark.parametrize("decoder", CPU_DECODERS)
@pytest.mark.parametrize("name", ["png_named.JPEG", "cmyk.JPEG", "bmp_named.JPEG", "plain.JPEG", "progressive.JPEG",
                                  "webp_named.JPEG", "rgba.png", "animated.gif"])
def test_colour_files_decode_to_their_rgb_pixels(quirky, decoder, name):
    pixels = decode(decoder, quirky / name)
    assert pixels.shape == (48, 64, 3) and pixels.dtype == np.uint8
    # Away from the colour edge, where JPEG's blocks blur it (an animated file gives its first frame).
    assert np.abs(pixels[:, :24].astype(int) - LEFT).max() <= 4
    assert np.abs(pixels[:, 40:].astype(int) - RIGHT).max() <= 4


@pytest.mark.parametrize("decoder", CPU_DECODERS)
@pytest.mark.parametrize("name", ["gray.JPEG", "gray16.png"])
def test_grayscale_becomes_three_equal_uint8_channels(quirky, decoder, name):
    pixels = decode(decoder, quirky / name).astype(int)
    luma = np.asarray(Image.fromarray(two_colour()).convert("L"), dtype=int)
    assert pixels.shape == (48, 64, 3)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    if name == "gray.JPEG":
        assert np.abs(pixels[:, :24, 0] - luma[:, :24]).max() <= 3
    else:  # 16 bit scaled to 8, whatever the decoder's rounding
        assert np.abs(pixels[:, :24, 0] - LEFT[0]).max() <= 1 and np.abs(pixels[:, 40:, 0] - RIGHT[0]).max() <= 1


@pytest.mark.parametrize("decoder", TENSOR_DECODERS)
def test_tensor_decoders_give_the_pixels_pil_gives_for_jpegs(quirky, decoder):
    for name in ("plain", "progressive", "cmyk", "gray", "png_named"):
        path = quirky / f"{name}.JPEG"
        assert np.array_equal(decode(decoder, path), decode("pil", path)), name


def test_only_torchcodec_and_nvimgcodec_apply_the_exif_orientation(quirky):
    shapes = {decoder: decode(decoder, quirky / "exif_rotated.JPEG").shape for decoder in ("torchvision", "pil")}
    assert shapes == {"torchvision": (48, 64, 3), "pil": (48, 64, 3)}
    if HAS_TORCHCODEC:  # torchcodec 0.17 rotates by the EXIF tag, with no switch to turn it off
        assert decode("torchcodec", quirky / "exif_rotated.JPEG").shape == (64, 48, 3)
    if HAS_NVIMGCODEC and HAS_TORCHCODEC:  # nvImageCodec as TorchCodec, so that auto's choice keeps its pixels
        path = quirky / "exif_rotated.JPEG"
        assert np.array_equal(decode("nvimgcodec", path), decode("torchcodec", path))


@pytest.mark.parametrize("decoder", CPU_DECODERS)
@pytest.mark.parametrize("name", ["truncated", "not_an_image", "empty"])
def test_broken_file_raises_an_error_naming_it_and_the_fix(quirky, decoder, name):
    with pytest.raises(UnreadableImageError) as caught:
        image_loader(decoder)(str(quirky / f"{name}.JPEG"))
    assert str(quirky / f"{name}.JPEG") in str(caught.value)
    assert "data.on_corrupt=skip" in str(caught.value)


@pytest.fixture
def folder_with_a_broken_file(tiny_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    victim = sorted((root / "train" / "dog").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:300])
    return root, victim


@pytest.mark.parametrize("decoder", CPU_DECODERS)
def test_skip_mode_leaves_the_file_out_and_counts_it(folder_with_a_broken_file, caplog, decoder):
    root, victim = folder_with_a_broken_file
    dataset = DecodedImages(folder_samples(root / "train"), transform=pil_to_tensor if decoder == "pil" else None,
                                 decoder=decoder, on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="classifier_engine.data.image_folders"):
        batches = list(DataLoader(dataset, batch_size=8, collate_fn=collate_readable))
    assert sum(len(targets) for _images, targets in batches) == len(dataset) - 1
    [message] = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert message.startswith(f"skipped unreadable {victim} ({LIBRARY[decoder]}")
    assert message.endswith("[1 skipped so far by the main process]")


def test_skip_mode_leaves_out_an_evaluation_batch_none_of_whose_images_decode(tiny_root, tmp_path):
    # It stopped the run ("all 2 images of a batch were unreadable"): predict then wrote none of the other predictions.
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    first_two = sorted((root / "val" / "cat").iterdir())[:2]  # the first batch of the evaluation order
    for path in first_two:
        path.write_bytes(b"")
    module = ImageFolderDataModule(root=str(root), batch_size=2, num_workers=0, pin_memory=False, decoder="pil",
                                   on_corrupt="skip", eval_resize_size=32, eval_crop_size=32)
    module.setup("validate")
    assert sum(len(targets) for _images, targets in module.val_dataloader()) == 17 - 2


def test_skip_mode_stops_on_a_training_batch_left_with_one_image_in_one_line():
    # A training batch of one image raised BatchNorm's ValueError with a traceback.
    sample = (torch.zeros(3, 8, 8), 0)
    assert len(collate_readable([None, sample, sample])[1]) == 2
    with pytest.raises(UnreadableImageError, match=r"^a training batch kept 1 of its 2 images \(the others were "
                                                   r"unreadable, see the warnings naming them\): a batch of 1 "
                                                   r"may fail BatchNorm"):
        collate_readable([None, sample], training=True)
    assert len(collate_readable([None, sample])[1]) == 1  # an evaluation batch of one image is one


@pytest.mark.parametrize("decoder", CPU_DECODERS)
def test_error_mode_stops_the_loader_with_the_file_name(folder_with_a_broken_file, decoder):
    root, victim = folder_with_a_broken_file
    dataset = DecodedImages(folder_samples(root / "train"), transform=pil_to_tensor if decoder == "pil" else None,
                                 decoder=decoder)
    with pytest.raises(UnreadableImageError, match=str(victim)):
        list(DataLoader(dataset, batch_size=8, num_workers=1))  # the worker's error reaches the main process


@pytest.mark.parametrize("decoder", TENSOR_DECODERS)
def test_scan_lists_unreadable_files(folder_with_a_broken_file, capsys, decoder):
    root, victim = folder_with_a_broken_file
    assert main([str(root), "--workers", "2", "--decoder", decoder]) == 1
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    assert line.startswith(f"{victim}: {LIBRARY[decoder]}")
    assert f"57 images checked under {root} with {decoder}, 1 unreadable" in err


def test_scan_reads_what_a_fit_reads_and_bad_arguments_are_one_line(folder_with_a_broken_file, tmp_path, capsys):
    # A dangling link was a FileNotFoundError traceback, a linked class folder was not looked into, and a missing root,
    # --workers 0 and an unknown decoder were "0 images checked" (exit 0) or tracebacks.
    root, victim = folder_with_a_broken_file
    (root / "train" / "cat" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    shutil.move(root / "train" / "dog", tmp_path / "dog")
    (root / "train" / "dog").symlink_to(tmp_path / "dog")
    assert main([str(root), "--workers", "1", "--decoder", "pil"]) == 1
    out, err = capsys.readouterr()
    assert sorted(line.split(": ")[0] for line in out.splitlines()) == [str(root / "train" / "cat" / "gone.jpg"),
                                                                         str(victim)], out
    assert f"58 images checked under {root} with pil, 2 unreadable" in err
    for argv, said in (([str(tmp_path / "none")], f"{tmp_path / 'none'} is not a folder: pass the data's root"),
                       ([str(root), "--workers", "0"], "--workers 0: expected a number of processes >= 1"),
                       ([str(root), "--decoder", "turbo"], "data.decoder must be one of auto, ")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
    # As a command: the same one line (runpy warned first of the module the package had imported).
    run = subprocess.run([sys.executable, "-m", "classifier_engine.data.decoders", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stderr.strip().splitlines()) == (2, [
        f"python -m classifier_engine.data.decoders: error: {tmp_path / 'none'} is not a folder: pass the data's root "
        "(or any folder of images)"]), run.stderr


def test_auto_takes_the_first_available_and_unknown_names_are_refused():
    first = "nvimgcodec" if HAS_NVIMGCODEC else "torchcodec" if HAS_TORCHCODEC else "torchvision"
    assert resolve_decoder("auto") == first
    assert resolve_decoder("nvjpeg") == "nvjpeg"
    with pytest.raises(ValueError, match="data.decoder must be one of auto, nvimgcodec, torchcodec, torchvision, pil, "
                                         "nvjpeg, torchcodec-cuda; got 'turbojpeg'"):
        DecodedImages([], decoder="turbojpeg")


REMOVED_TORCHVISION_IO = """
import torchvision.io
import torchvision.transforms.v2  # torchvision's own JPEG augmentation imports them: loaded before they go
for name in ("decode_image", "decode_jpeg", "ImageReadMode"):
    delattr(torchvision.io, name)  # what a torchvision without image decoders looks like to `from ... import`
from classifier_engine.data.decoders import image_loader, resolve_decoder
print(resolve_decoder("auto"), tuple(image_loader("auto")(PATH).shape))
for name in ("torchvision", "nvjpeg"):
    try:
        image_loader(name)
    except ValueError as error:  # ConfigError: one line for the user
        print(error)
"""


@pytest.mark.slow  # another process
def test_without_torchvision_io_decoders_auto_falls_back_and_torchvision_says_why(quirky):
    script = f"PATH = {str(quirky / 'cmyk.JPEG')!r}\n" + REMOVED_TORCHVISION_IO
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    chosen, torchvision_error, nvjpeg_error = result.stdout.splitlines()
    assert chosen == ("nvimgcodec" if HAS_NVIMGCODEC else "torchcodec" if HAS_TORCHCODEC else "pil") + " (3, 48, 64)"
    assert torchvision_error.startswith("data.decoder=torchvision needs torchvision.io.decode_image, which "
                                        "torchvision ")
    assert torchvision_error.endswith('pip install -e "./engine[torchcodec]" (from a clone), or pip install '
                                      '"classifier-engine[torchcodec]" and set data.decoder=torchcodec (or auto), or '
                                      'use pil')
    assert nvjpeg_error.startswith("data.decoder=nvjpeg: data.decoder=torchvision needs torchvision.io.decode_image")


def loader_batch(root, split: str, **options):
    module = ImageFolderDataModule(str(root), batch_size=64, num_workers=0, pin_memory=False, train_crop_size=24,
                                eval_resize_size=28, eval_crop_size=24, **options)
    module.setup("fit")
    torch.manual_seed(0)  # the same crops in both pipelines: ToDtype and Normalize draw no random numbers
    loader = module.train_dataloader() if split == "train" else module.val_dataloader()
    return module, next(iter(loader))


@pytest.mark.parametrize("decoder", TENSOR_DECODERS)
@pytest.mark.parametrize("split", ["train", "val"])
def test_uint8_batches_normalized_on_device_equal_the_stock_float_path(tiny_root, split, decoder):
    _, (stock, stock_targets) = loader_batch(tiny_root, split, decoder="pil", normalize_on_device=False)
    module, (fast, fast_targets) = loader_batch(tiny_root, split, decoder=decoder, normalize_on_device=True)
    assert fast.dtype == torch.uint8 and stock.dtype == torch.float32
    images, targets = module.on_after_batch_transfer((fast, fast_targets), 0)
    assert torch.equal(targets, stock_targets)
    assert images.dtype == torch.float32 and images.shape == stock.shape
    torch.testing.assert_close(images, stock, atol=1e-5, rtol=0)
