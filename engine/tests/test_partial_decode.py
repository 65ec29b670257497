"""Decoding only what the crop keeps (data.decoder=nvimgcodec, auto's first choice): the same draws and, where no DCT
scale applies, the same pixels as decoding whole; within the documented tolerance where one does (docs/imagenet.md),
on ImageNet-shaped JPEGs, gray, CMYK, progressive and EXIF-rotated ones included; bad files named or skipped; forked
workers give the main process's batches; the quickstart trains to the same value either way.

    python -m pytest tests/test_partial_decode.py
"""

import numpy as np
import pytest
import torch
from PIL import Image

from classifier_engine import ImageFolderDataModule
from classifier_engine.data.decoders import image_loader, unavailable
from classifier_engine.data.image_folders import DecodedImages
from classifier_engine.data.partial_decode import EncodedJpeg, dct_scale
from classifier_engine.data.transforms import eval_preset, train_preset
from classifier_engine.errors import UnreadableImageError
from conftest import SHRINK, cli_main, tiny_args, write_image_folder

pytestmark = pytest.mark.skipif(unavailable("nvimgcodec") is not None, reason=str(unavailable("nvimgcodec")))
# Mean absolute difference (uint8 levels) of a crop decoded at a DCT scale from the same crop decoded whole, on these
# grain-heavy photos (the worst case: detail near the pixel pitch, where libjpeg's scaled IDCT and an antialiased
# resize filter differently); 0.2-0.4 on smooth content. docs/imagenet.md, "Decoding only what the crop keeps".
SCALED_MEAN_ABS = 6.0


def photo(seed: int, width: int, height: int) -> Image.Image:
    """Smooth colour blobs plus grain: compresses and decodes like a photo (bench/fake_imagenet.py's recipe)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(2, height // 48), max(2, width // 48), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    return Image.fromarray(np.clip(smooth + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jpegs")
    photo(0, 500, 375).save(folder / "landscape.JPEG", quality=90)
    photo(1, 333, 500).save(folder / "portrait.JPEG", quality=90)
    photo(2, 1280, 960).save(folder / "large.JPEG", quality=90)  # every 224 crop of half its area or more scales
    photo(3, 640, 480).save(folder / "progressive.JPEG", quality=90, progressive=True)
    photo(4, 500, 400).save(folder / "subsampling_444.JPEG", quality=90, subsampling=0)
    photo(5, 1024, 768).convert("L").save(folder / "gray.JPEG", quality=90)
    photo(6, 1024, 768).convert("CMYK").save(folder / "cmyk.JPEG", quality=90)  # Adobe-inverted, as Photoshop's
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate a quarter turn to display: TorchCodec and nvImageCodec do
    photo(7, 1024, 768).save(folder / "exif_rotated.JPEG", quality=90, exif=exif)
    return sorted(folder.iterdir())


def seeded(preset, image, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = preset(image)
    return out, torch.random.get_rng_state()


@pytest.mark.parametrize("crop_size", [224, 160, 96])
def test_train_crops_are_the_whole_decodes_exactly_or_within_tolerance_where_a_scale_applies(jpegs, crop_size):
    preset, whole, partial = train_preset(crop_size=crop_size, normalize=False), image_loader("nvimgcodec"), \
        image_loader("nvimgcodec", partial=True)
    scaled = 0
    for path in jpegs:
        encoded = partial(str(path))
        assert isinstance(encoded, EncodedJpeg) and encoded.height, path.name
        for seed in range(12):
            expected, expected_state = seeded(preset, whole(str(path)), seed)
            got, state = seeded(preset, encoded, seed)
            assert torch.equal(state, expected_state), "the sample seed must decide every later draw"
            torch.manual_seed(seed)
            box = preset.transforms[1].make_params([encoded.size_proxy()])
            k = dct_scale(box["height"], box["width"], crop_size, crop_size)
            if k == 1 or "cmyk" in path.name or "exif" in path.name:  # those decode the region at full scale
                assert torch.equal(got, expected), (path.name, seed)
            else:
                scaled += 1
                assert got.shape == expected.shape
                assert (got.int() - expected.int()).abs().float().mean() <= SCALED_MEAN_ABS, (path.name, seed, k)
    assert scaled > 0  # the large and gray files at least


def test_eval_images_are_the_whole_decodes_below_twice_the_resize_and_within_tolerance_above(jpegs):
    preset, whole, partial = eval_preset(normalize=False), image_loader("nvimgcodec"), \
        image_loader("nvimgcodec", partial=True)
    for path in jpegs:
        expected, got = preset(whole(str(path))), preset(partial(str(path)))
        height, width = expected.shape[1:]
        if min(Image.open(path).size) < 2 * 256 or "cmyk" in path.name or "exif" in path.name:
            assert torch.equal(got, expected), path.name
        else:
            assert got.shape == expected.shape and (got.int() - expected.int()).abs().float().mean() <= SCALED_MEAN_ABS


def test_partial_and_whole_decodes_match_the_stock_decoders(jpegs):
    # nvImageCodec is libjpeg-turbo as torchvision.io and PIL are (and applies EXIF as TorchCodec does).
    for path in jpegs:
        if "exif" not in path.name:
            assert torch.equal(image_loader("nvimgcodec")(str(path)), image_loader("torchvision")(str(path))), path


@pytest.mark.parametrize("on_corrupt", ["error", "skip"])
def test_a_jpeg_cut_short_is_named_or_skipped_when_decoded_in_part(jpegs, tmp_path, on_corrupt):
    cut = tmp_path / "cut.JPEG"
    data = jpegs[0].read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # rows at the top still decode: the crop alone could miss the damage
    images = DecodedImages([(str(cut), 0), (str(jpegs[0]), 1)], transform=train_preset(crop_size=64),
                           decoder="nvimgcodec", on_corrupt=on_corrupt, partial=True)
    if on_corrupt == "error":
        with pytest.raises(UnreadableImageError, match=str(cut)):
            images[0]
    else:
        assert images[0] is None and images.skipped == 1 and images[1][1] == 1


def test_forked_workers_decode_in_part_as_the_main_process_does(tmp_path):
    root = write_image_folder(tmp_path, {"a": (12, 2), "b": (12, 2)}, size=96)

    def first_batch(workers: int) -> torch.Tensor:
        module = ImageFolderDataModule(str(root), batch_size=8, num_workers=workers, pin_memory=False,
                                       train_crop_size=40, decoder="nvimgcodec")
        module.setup("fit")
        return next(iter(module.train_dataloader()))[0]

    in_main = first_batch(0)  # decoders made in this process first: the forked workers make their own
    assert torch.equal(first_batch(2), in_main)


@pytest.mark.slow  # two fits
def test_the_quickstart_trains_to_the_same_value_decoding_whole_or_in_part(tmp_path):
    metrics = {}
    for decoder in ("torchvision", "nvimgcodec"):
        cli = cli_main(["fit", *tiny_args(None, tmp_path / decoder, f"--data.decoder={decoder}")])
        metrics[decoder] = {key: float(value) for key, value in cli.trainer.callback_metrics.items()}
    assert metrics["nvimgcodec"] == metrics["torchvision"] and "val/acc1" in metrics["torchvision"]
    assert "--trainer.max_epochs=1" in SHRINK  # ...of one epoch: bit-identical pixels give bit-identical runs
