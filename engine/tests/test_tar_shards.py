"""WebDataset tars (make_shards.py --format webdataset, tar_shards.py in classifier_engine/data): written so the
`webdataset` package reads them back, read by ShardDataModule with our shards' guarantees (training, exact evaluation at
any world size, resume mid-epoch in the same order), and a damaged or crafted tar is one line naming it.

    python -m pytest engine/tests/test_tar_shards.py --durations=0
"""

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from classifier_engine import ShardDataModule
from classifier_engine.data.layout import check_layout, folder_samples
from classifier_engine.data.make_shards import main as make_shards
from classifier_engine.errors import ConfigError, UnreadableImageError
from conftest import QUICKSTART, SHRINK, cli_main, make_shards_killed_at, project_in_process
from local_services import s3_server

SMALL = ["--shard-size", "8", "--workers", "1"]  # tiny_root: 40 train images in 5 tars, 17 val in 3
FAST = dict(batch_size=8, num_workers=0, pin_memory=False, train_crop_size=32, eval_resize_size=32, eval_crop_size=32)


@pytest.fixture(scope="module")
def tars(tiny_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("tars") / "tiny-wds"
    assert make_shards(["--source", str(tiny_root), "--out", str(out), *SMALL, "--format", "webdataset"]) == 0
    return out


def data(folder, cache, **options) -> ShardDataModule:
    return ShardDataModule(shards=str(folder), cache_dir=str(cache), **{**FAST, **options})


def test_make_shards_writes_tars_the_webdataset_package_reads_back_with_their_labels(tiny_root, tars):
    import webdataset  # the dev extra's: a missing install fails here rather than skipping
    assert sorted(p.name for p in tars.glob("*.tar")) == [f"train-{k:04d}.tar" for k in range(5)] + [
        f"validation-{k:04d}.tar" for k in range(3)]
    classes = check_layout(tiny_root)
    for split, name in (("train", "train"), ("val", "validation")):
        files = [str(tars / f"{name}-{k:04d}.tar") for k in range(5 if split == "train" else 3)]
        read = list(webdataset.WebDataset(files, shardshuffle=False, empty_check=False))
        source = folder_samples(tiny_root / split, classes)
        assert [sample["__key__"] for sample in read] == [f"{i:08d}" for i in range(len(source))]
        assert [int(sample["cls"]) for sample in read] == [label for _, label in source]
        assert all(sample["jpg"] == Path(path).read_bytes() for sample, (path, _) in zip(read, source))  # 32 px: kept
    info = json.loads((tars / "_info.json").read_text())  # timm's reader takes each split's files and lengths here
    assert info["splits"]["validation"]["shard_lengths"] == [8, 8, 1] and info["classes"] == classes


def test_tars_read_as_the_same_images_and_labels_as_our_shards(tiny_root, tars, tmp_path):
    ours = tmp_path / "ours"
    assert make_shards(["--source", str(tiny_root), "--out", str(ours), *SMALL]) == 0
    from_tars, from_shards = (data(f, tmp_path / "cache", decoder="pil")._images("val", None) for f in (tars, ours))
    assert len(from_tars) == len(from_shards) == 17
    for index in range(17):
        (a, y), (b, z) = from_tars[index], from_shards[index]
        assert y == z and list(a.getdata()) == list(b.getdata())
    assert data(tars, tmp_path / "cache").class_names == ["cat", "dog", "fox"]  # from _info.json


def test_shard_data_module_trains_on_webdataset_tars(tars, tmp_path):
    cli_main(["fit", "--config", str(QUICKSTART), *SHRINK, "--data.class_path=classifier_engine.data.ShardDataModule",
              f"--data.init_args.shards={tars}", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
              "--trainer.limit_train_batches=3", f"--trainer.default_root_dir={tmp_path}"])
    checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=True)
    assert checkpoint["global_step"] == 3
    assert len(list((tmp_path / "cache" / "webdataset").glob("*.json"))) == 1  # the tars' index, built once


def test_evaluation_reads_every_tar_sample_once_at_1_2_and_3_ranks(tars, tmp_path):
    for world_size in (1, 2, 3):  # 17 images: 17; 9 + 8; 6 + 6 + 5
        seen, labels = [], []
        for rank in range(world_size):
            module = data(tars, tmp_path / "cache")
            module.trainer = SimpleNamespace(world_size=world_size, global_rank=rank)
            module.setup("validate")
            loader = module.val_dataloader()
            seen += list(loader.sampler)
            labels += [y for _, batch in loader for y in batch.tolist()]
        assert sorted(seen) == list(range(17)), world_size
        assert sorted(labels) == sorted(module.datasets["val"][i][1] for i in range(17))


def test_a_loader_resumed_mid_epoch_gives_the_uninterrupted_rest_of_the_epoch(tars, tmp_path):
    def loader(state=None):
        module = data(tars, tmp_path / "cache", seed=5, shuffle_window=2)
        module.setup("fit")
        built = module.train_dataloader()
        if state is not None:
            built.load_state_dict(state)
        return built

    orders = [loader().sampler.epoch_order(0) for _ in range(2)]
    assert orders[0] == orders[1] and sorted(index for index, _ in orders[0]) == list(range(40))  # from the seed
    uninterrupted = [(images, labels) for images, labels in loader()]
    first = loader()
    batches = iter(first)
    taken = [next(batches) for _ in range(2)]
    state = first.state_dict()
    assert state["position"] == 16
    rest = list(loader(state))
    assert len(uninterrupted) == 5 and len(rest) == 3
    for (images, labels), (expected, expected_labels) in zip(taken + rest, uninterrupted):
        assert torch.equal(labels, expected_labels) and torch.equal(images, expected)  # the same crops too


def damaged_copy(tars, folder, change) -> str:
    shutil.copytree(tars, folder)
    change(folder)
    return str(folder)


def add_member(path, name: str, body: bytes = b"x") -> None:
    with tarfile.open(path, "a") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))


def cut_at_a_member(path, index: int) -> None:
    with tarfile.open(path) as tar:
        end = tar.getmembers()[index].offset  # where member `index`'s header starts: members before it whole
    path.write_bytes(path.read_bytes()[:end])


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# (how the set is damaged, the one line's expected text)
CRAFTED = {
    "a member named ../x": (lambda f: add_member(f / "train-0001.tar", "../x.jpg"),
                            "train-0001.tar: member '../x.jpg' names a path outside the tar"),
    "an absolute member": (lambda f: add_member(f / "train-0001.tar", "/etc/x.jpg"),
                           "train-0001.tar: member '/etc/x.jpg' names a path outside the tar"),
    "a sample without .cls": (lambda f: add_member(f / "validation-0002.tar", "00000099.jpg"),
                              "validation-0002.tar: sample '00000099' has no .cls (the class index as text)"),
    "a .cls that is not a number": (lambda f: [add_member(f / "validation-0002.tar", name, body) for name, body in
                                               (("00000099.jpg", b"x"), ("00000099.cls", b"cat"))],
                                    "sample '00000099': its .cls is b'cat', expected a class index"),
    "a gzipped tar": (lambda f: (f / "train-0002.tar").write_bytes(gzip.compress(
        (f / "train-0002.tar").read_bytes())), "train-0002.tar: unreadable as an uncompressed tar"),
    "a tar named without a split": (lambda f: shutil.copy(f / "train-0000.tar", f / "shard-0000.tar"),
                                    "shard-0000.tar: expected WebDataset tars named <set>-<train|validation|test>"),
    "a tar cut at a member's end, no _info.json": (lambda f: [(f / "_info.json").unlink(), cut_at_a_member(
        f / "train-0000.tar", 4)], "train-0000.tar: cut short after member '00000001.cls' (no end-of-archive blocks)"),
    "a tar _info.json lists missing": (lambda f: (f / "validation-0001.tar").unlink(),
                                       "validation-0001.tar is missing, and _info.json lists it in validation"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_or_damaged_tar_is_one_line_naming_it_before_a_run_dir_is_made(case, tars, tmp_path, monkeypatch,
                                                                                  capsys):
    change, expected = CRAFTED[case]
    folder = damaged_copy(tars, tmp_path / "set", change)
    run = tmp_path / "run"
    code, _, err = project_in_process(["fit", "--config", str(QUICKSTART), *SHRINK,
                                       "--data.class_path=classifier_engine.data.ShardDataModule",
                                       f"--data.init_args.shards={folder}",
                                       f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                                       f"--trainer.default_root_dir={run}"], monkeypatch, capsys)
    assert code == 2 and expected in one_line(err), err[-2000:]
    assert not run.exists()


def test_a_corrupt_image_member_is_one_line_naming_the_tar_and_its_key(tars, tmp_path):
    cache = tmp_path / "cache"
    val = data(tars, cache)._images("val", None)
    tar = val.shards[1]  # validation-0001.tar; its second sample is the split's image 9, key 00000009

    def zeroed(folder):  # the same size, other bytes: the tar's headers stay valid
        with open(folder / tar["file"], "r+b") as file:
            file.seek(tar["offsets"][1])
            file.write(bytes(tar["lengths"][1]))

    damaged = data(damaged_copy(tars, tmp_path / "set", zeroed), cache)._images("val", None)
    with pytest.raises(UnreadableImageError) as error:
        damaged[9]
    assert "validation-0001.tar (key '00000009')" in one_line(str(error.value))
    assert damaged[8][1] == val[8][1] and damaged[10][1] == val[10][1]  # its neighbours read as before


@pytest.fixture(scope="module")
def object_store():
    """moto's S3 server on 127.0.0.1 and a bucket, without authentication: with it, moto 5.2 refuses to list a prefix
    (SignatureDoesNotMatch, getmoto/moto#5948), which AWS and MinIO answer; stopped after."""
    with s3_server(bucket="datasets", authenticated=False) as env:
        yield env


@pytest.mark.slow
def test_tars_on_an_object_store_read_as_the_local_ones_through_the_shard_cache(tiny_root, tars, object_store,
                                                                                 tmp_path, monkeypatch):
    for name, value in object_store.items():
        monkeypatch.setenv(name, value)
    url = "s3://datasets/wds"
    assert make_shards(["--source", str(tiny_root), "--out", url, *SMALL, "--format", "webdataset"]) == 0
    cache = tmp_path / "cache"
    remote, local = data(url, cache), data(tars, cache)
    assert remote.class_names == local.class_names == ["cat", "dog", "fox"]
    downloaded = sorted(p.name for p in (cache / "datasets" / "wds").glob("*.tar"))
    assert downloaded == sorted(p.name for p in tars.glob("*.tar"))  # each tar once, into the cache, then indexed
    val = [module._images("val", None) for module in (remote, local)]
    assert all(torch.equal(val[0][i][0], val[1][i][0]) and val[0][i][1] == val[1][i][1] for i in range(17))


def test_a_rerun_over_fewer_images_leaves_no_tar_of_the_old_set_and_an_unlisted_tar_is_refused(tiny_root, tmp_path,
                                                                                               monkeypatch, capsys):
    # A rerun that wrote fewer tars left the old set's last ones: validation counted images deleted from the source.
    source, out = tmp_path / "source", tmp_path / "wds"
    shutil.copytree(tiny_root, source)
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL, "--format", "webdataset"]) == 0
    for split, keep in (("val", 2), ("train", 6)):  # 6 val images in 1 tar, 18 train in 3 (the old set: 3 and 5)
        for folder in (source / split).iterdir():
            for path in sorted(folder.iterdir())[keep:]:
                path.unlink()
    argv = ["--source", str(source), "--out", str(out), *SMALL, "--format", "webdataset"]
    make_shards_killed_at(9, monkeypatch, argv)  # in its second tar: the old set's extra tars went first
    assert make_shards(argv) == 0
    tars = sorted(p.name for p in out.glob("*.tar"))
    assert tars == ["train-0000.tar", "train-0001.tar", "train-0002.tar", "validation-0000.tar"]
    assert len(data(out, tmp_path / "cache")._images("val", None)) == 6
    # Another tool's set in --out (its own _info.json, no records of ours): a rerun leaves its tars alone.
    (out / "imagenet1k-validation-00.tar").write_bytes((out / "validation-0000.tar").read_bytes())
    info = json.loads((out / "_info.json").read_text())
    info["fingerprint"] = "another set"
    info["splits"]["validation"]["filenames"] = ["imagenet1k-validation-00.tar", "validation-0000.tar"]
    (out / "_info.json").write_text(json.dumps(info))
    assert make_shards(["--source", str(source), "--out", str(out), *SMALL, "--format", "webdataset"]) == 0
    assert (out / "imagenet1k-validation-00.tar").is_file()
    (out / "imagenet1k-validation-00.tar").unlink()
    shutil.copy(out / "validation-0000.tar", out / "validation-0001.tar")  # a tar _info.json does not list
    with pytest.raises(ConfigError, match=r"validation-0001.tar is not one of the tars _info.json lists for "
                                          r"validation: .* remove it, or rewrite the set"):
        data(out, tmp_path / "cache")._images("val", None)
