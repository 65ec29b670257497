"""ImageNet's quirky files (PNG named .JPEG, CMYK, grayscale, formats torchvision.io lacks) decode to RGB; broken ones
are named or skipped; the faster loader path gives the same batches as the stock one.

    python -m pytest tests/test_decode.py
"""

import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms.v2.functional import pil_to_tensor

from project.data.datamodule import ImageNetDataModule
from project.data.decoders import (DecodedImageFolder, UnreadableImageError, collate_readable, decode_pil,
                                 decode_torchvision, main)
from project.data.device_decode import EncodedBatch, jpeg_frame, load_for_device

LEFT, RIGHT = (200, 30, 40), (20, 180, 220)  # flat halves: JPEG keeps flat colours within a few levels


def two_colour(height: int = 48, width: int = 64) -> np.ndarray:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2], pixels[:, width // 2 :] = LEFT, RIGHT
    return pixels


def as_rgb_array(image) -> np.ndarray:
    """(H, W, 3) uint8 from either decoder's output (PIL image or CHW tensor)."""
    return np.array(image) if isinstance(image, Image.Image) else image.permute(1, 2, 0).numpy()


@pytest.fixture(scope="module")
def quirky(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quirky")
    source = Image.fromarray(two_colour())
    source.save(folder / "png_named.JPEG", format="PNG")  # as n02105855_2933.JPEG in ImageNet's train set
    source.convert("CMYK").save(folder / "cmyk.JPEG", quality=95)  # Adobe-marked, inverted: Photoshop's CMYK
    source.convert("L").save(folder / "gray.JPEG", quality=95)
    source.save(folder / "bmp_named.JPEG", format="BMP")  # a format torchvision.io does not read: PIL fallback
    source.save(folder / "plain.JPEG", quality=95)
    whole = (folder / "plain.JPEG").read_bytes()
    (folder / "truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    (folder / "not_an_image.JPEG").write_bytes(b"<html>403 Forbidden</html>")
    (folder / "empty.JPEG").write_bytes(b"")
    return folder


@pytest.mark.parametrize("decode", [decode_torchvision, decode_pil], ids=["torchvision", "pil"])
@pytest.mark.parametrize("name", ["png_named", "cmyk", "bmp_named", "plain"])
def test_colour_files_decode_to_their_rgb_pixels(quirky, decode, name):
    pixels = as_rgb_array(decode(str(quirky / f"{name}.JPEG")))
    assert pixels.shape == (48, 64, 3) and pixels.dtype == np.uint8
    # Away from the colour edge, where JPEG's blocks blur it.
    assert np.abs(pixels[:, :24].astype(int) - LEFT).max() <= 4
    assert np.abs(pixels[:, 40:].astype(int) - RIGHT).max() <= 4


@pytest.mark.parametrize("decode", [decode_torchvision, decode_pil], ids=["torchvision", "pil"])
def test_grayscale_jpeg_becomes_three_equal_channels(quirky, decode):
    pixels = as_rgb_array(decode(str(quirky / "gray.JPEG"))).astype(int)
    luma = np.asarray(Image.fromarray(two_colour()).convert("L"), dtype=int)
    assert pixels.shape == (48, 64, 3)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()
    assert np.abs(pixels[:, :24, 0] - luma[:, :24]).max() <= 3


def test_both_decoders_give_identical_pixels_for_jpegs(quirky):
    for name in ("plain", "cmyk", "gray", "png_named"):
        path = str(quirky / f"{name}.JPEG")
        assert torch.equal(decode_torchvision(path), torch.from_numpy(as_rgb_array(decode_pil(path))).permute(2, 0, 1))


@pytest.mark.parametrize("decode", [decode_torchvision, decode_pil], ids=["torchvision", "pil"])
@pytest.mark.parametrize("name", ["truncated", "not_an_image", "empty"])
def test_broken_file_raises_an_error_naming_it_and_the_fix(quirky, decode, name):
    with pytest.raises(UnreadableImageError) as caught:
        decode(str(quirky / f"{name}.JPEG"))
    assert str(quirky / f"{name}.JPEG") in str(caught.value)
    assert "data.on_corrupt=skip" in str(caught.value)


@pytest.fixture
def folder_with_a_broken_file(tiny_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    victim = sorted((root / "train" / "dog").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:300])
    return root, victim


def test_skip_mode_leaves_the_file_out_and_counts_it(folder_with_a_broken_file, caplog):
    root, victim = folder_with_a_broken_file
    dataset = DecodedImageFolder(str(root / "train"), decoder="torchvision", on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="project.data.decoders"):
        batches = list(DataLoader(dataset, batch_size=8, collate_fn=collate_readable))
    assert sum(len(targets) for _images, targets in batches) == len(dataset) - 1
    [message] = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert message.startswith(f"skipped unreadable {victim} (torchvision.io: Image is incomplete or truncated; PIL: ")
    assert message.endswith("[1 skipped so far by the main process]")


def test_error_mode_stops_the_loader_with_the_file_name(folder_with_a_broken_file):
    root, victim = folder_with_a_broken_file
    dataset = DecodedImageFolder(str(root / "train"), transform=pil_to_tensor, decoder="pil")
    with pytest.raises(UnreadableImageError, match=str(victim)):
        list(DataLoader(dataset, batch_size=8, num_workers=1))  # the worker's error reaches the main process


def test_scan_lists_unreadable_files(folder_with_a_broken_file, capsys):
    root, victim = folder_with_a_broken_file
    assert main([str(root), "--workers", "2"]) == 1
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    assert line.startswith(f"{victim}: torchvision.io: Image is incomplete or truncated; PIL: ")
    assert "57 images checked" in err and "1 unreadable" in err


def loader_batch(root, split: str, **options):
    module = ImageNetDataModule(str(root), batch_size=64, num_workers=0, pin_memory=False, train_crop_size=24, eval_resize_size=28,
                                eval_crop_size=24, **options)
    module.setup("fit")
    torch.manual_seed(0)  # the same crops in both pipelines: ToDtype and Normalize draw no random numbers
    loader = module.train_dataloader() if split == "train" else module.val_dataloader()
    return module, next(iter(loader))


@pytest.mark.parametrize("split", ["train", "val"])
def test_uint8_batches_normalized_on_device_equal_the_stock_float_path(tiny_root, split):
    _, (stock, stock_targets) = loader_batch(tiny_root, split, decoder="pil", normalize_on_device=False)
    module, (fast, fast_targets) = loader_batch(tiny_root, split, decoder="torchvision", normalize_on_device=True)
    assert fast.dtype == torch.uint8 and stock.dtype == torch.float32
    images, targets = module.on_after_batch_transfer((fast, fast_targets), 0)
    assert torch.equal(targets, stock_targets)
    assert images.dtype == torch.float32 and images.shape == stock.shape
    torch.testing.assert_close(images, stock, atol=1e-5, rtol=0)


# decoder="nvjpeg": the routing and the batched device decode run here on the CPU (decode_jpeg(device="cpu")); the
# `gpu` test repeats the comparison with nvJPEG.
def test_jpeg_frame_header_routes_files_nvjpeg_cannot_decode_to_the_workers(quirky, tmp_path):
    Image.fromarray(two_colour()).save(tmp_path / "progressive.JPEG", quality=90, progressive=True)
    frames = {name: jpeg_frame((quirky / f"{name}.JPEG").read_bytes()) for name in ("plain", "gray", "cmyk", "png_named")}
    assert frames == {"plain": (0xC0, 3), "gray": (0xC0, 1), "cmyk": (0xC0, 4), "png_named": None}
    assert jpeg_frame((tmp_path / "progressive.JPEG").read_bytes()) == (0xC2, 3)
    shapes = {name: load_for_device(str(quirky / f"{name}.JPEG")).dim() for name in ("plain", "gray", "cmyk", "png_named")}
    assert shapes == {"plain": 1, "gray": 1, "cmyk": 3, "png_named": 3}  # bytes for the device, pixels decoded here


def device_decoded_val_batch(root, device: str):
    options = dict(batch_size=64, num_workers=0, pin_memory=False, eval_resize_size=28, eval_crop_size=24)
    reference = ImageNetDataModule(str(root), decoder="torchvision", **options)
    reference.setup("validate")
    images, targets = next(iter(reference.val_dataloader()))
    module = ImageNetDataModule(str(root), decoder="nvjpeg", **options)
    module.setup("validate")
    encoded = next(iter(module.val_dataloader()))
    assert isinstance(encoded, EncodedBatch) and all(p.dim() == 1 for p in encoded.payloads)
    decoded, decoded_targets = module.device_decoder(encoded, torch.device(device), training=False)
    return images, targets, decoded, decoded_targets


def test_device_decode_gives_the_worker_path_batch(tiny_root):
    images, targets, decoded, decoded_targets = device_decoded_val_batch(tiny_root, "cpu")
    assert torch.equal(decoded, images) and torch.equal(decoded_targets, targets)


@pytest.mark.gpu
def test_nvjpeg_decode_matches_the_cpu_batch_within_idct_differences(tiny_root):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    images, targets, decoded, decoded_targets = device_decoded_val_batch(tiny_root, "cuda")
    assert decoded.is_cuda and decoded.dtype == torch.uint8 and decoded.shape == images.shape
    assert torch.equal(decoded_targets.cpu(), targets)
    # nvJPEG's IDCT and the CUDA resize round differently from libjpeg-turbo and the CPU resize: small differences.
    assert (decoded.cpu().float() - images.float()).abs().mean() < 2.0


def test_fit_with_device_decode_skips_a_broken_jpeg(folder_with_a_broken_file, tmp_path, caplog):
    from conftest import tiny_args

    from project.cli import cli_main

    root, victim = folder_with_a_broken_file
    args = tiny_args(root, tmp_path / "run", "--data.decoder=nvjpeg", "--data.on_corrupt=skip",
                     "--trainer.limit_val_batches=1", "--trainer.logger=false")
    with caplog.at_level(logging.WARNING, logger="project.data.device_decode"):
        cli = cli_main(["fit", *args])
    assert cli.trainer.state.finished and cli.trainer.global_step == 5  # 40 images - 1 skipped, batches of 8
    [message] = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert message.startswith(f"skipped unreadable {victim}") and message.endswith("[device decode]")
