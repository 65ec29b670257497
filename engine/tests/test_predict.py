"""`python -m classifier_engine predict` writes one CSV: path, top-k class names and probabilities, in sorted path
order.

    python -m pytest tests/test_predict.py --durations=0
"""

import csv
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from PIL import Image

from classifier_engine.data.decoders import image_loader
from classifier_engine.data.predict import ImagePathDataset, list_images
from classifier_engine.data.transforms import eval_preset
from classifier_engine.errors import UnreadableImageError
from conftest import cli_main, model_class, project_in_process, run_project, tiny_args


def read_csv(path: Path) -> list[list[str]]:
    """As the writer's docstring says to: a name that is not UTF-8 comes back as the same bytes (os.fsencode)."""
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        return list(csv.reader(f))


def in_process(args: list[str]) -> None:
    # The CLI seeds and sets PL_GLOBAL_SEED; keep that out of the environment of the tests that follow.
    with mock.patch.dict(os.environ):
        cli_main(args)


@pytest.fixture(scope="module")
def checkpoint(tiny_root, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("predict_fit")
    in_process(["fit", *tiny_args(tiny_root, run_dir)])
    return run_dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def image_folder(tiny_root, tmp_path_factory) -> Path:
    """The 17 val images at two depths, one with an upper-case extension, beside files predict must skip."""
    folder = tmp_path_factory.mktemp("to_predict")
    shutil.copytree(tiny_root / "val", folder / "nested")
    for source in sorted((tiny_root / "val" / "fox").glob("*.jpg"))[:2]:
        shutil.move(folder / "nested" / "fox" / source.name, folder / source.name.upper())
    (folder / "notes.txt").write_text("not an image")
    (folder / ".thumbnails").mkdir()
    shutil.copy(source, folder / ".thumbnails" / "hidden.jpg")
    return folder


@pytest.fixture(scope="module")
def single_process_csv(tiny_root, checkpoint, image_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict_single") / "predictions.csv"
    run_dir = out.parent / "run"
    in_process(["predict", *tiny_args(tiny_root, run_dir), f"--ckpt_path={checkpoint}",
                f"--data.predict_root={image_folder}", f"--predictions.output={out}"])
    return out


def test_predict_lists_images_at_any_depth_in_sorted_path_order(image_folder):
    paths = list_images(image_folder)
    relative = [path.relative_to(image_folder).as_posix() for path in paths]
    assert len(paths) == 17
    assert relative == sorted(relative)
    assert relative[0] == "FOX_000.JPG" and "notes.txt" not in relative
    assert not any(part.startswith(".") for path in relative for part in path.split("/"))
    image, index = ImagePathDataset(image_folder)[5]
    assert index == 5 and image.dtype == torch.uint8 and image.shape == (3, 32, 32)


def test_predict_root_without_images_names_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no images"):
        list_images(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="--data.predict_root"):
        list_images(tmp_path / "missing")


@pytest.mark.slow  # its fixtures fit and predict in-process: ~20 s
def test_predict_csv_holds_each_images_top_classes_by_name_with_the_models_probabilities(
    single_process_csv, checkpoint, image_folder
):
    header, *rows = read_csv(single_process_csv)
    assert header == ["path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]  # 3 classes: top-3
    assert [row[0] for row in rows] == [str(path) for path in list_images(image_folder)]
    # Recompute every row with the checkpoint's network: each row belongs to its path, names in index order.
    model = model_class().load_from_checkpoint(checkpoint, map_location="cpu").eval()
    transform = eval_preset(resize_size=32, crop_size=32)
    names = ["cat", "dog", "fox"]
    with torch.no_grad():
        batch = torch.stack([transform(image_loader("auto")(row[0])) for row in rows])  # data.decoder's default
        expected = model(batch).softmax(dim=1).sort(dim=1, descending=True)
    for row, probs, classes in zip(rows, expected.values.tolist(), expected.indices.tolist()):
        assert row[1::2] == [names[c] for c in classes]
        assert [float(p) for p in row[2::2]] == pytest.approx(probs, abs=2e-6)


@pytest.mark.slow
def test_ddp_two_ranks_gather_into_one_csv_equal_to_the_single_process_one(
    tiny_root, checkpoint, image_folder, single_process_csv, tmp_path
):
    # 17 images over 2 ranks: shards of 9 and 8. No --predictions.output: the file goes into the run's log dir.
    ranks = ["--trainer.strategy=ddp_fork", "--trainer.devices=2"]  # forked ranks: test_distributed.FORKED_DDP
    result = run_project(["predict", *tiny_args(tiny_root, tmp_path, *ranks), f"--ckpt_path={checkpoint}",
                          f"--data.predict_root={image_folder}"])
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(tmp_path.rglob("*.csv"))
    assert written == [tmp_path / "lightning_logs" / "version_0" / "predictions.csv"]
    assert (result.stdout + result.stderr).count("predictions for 17 images written to") == 1
    ddp_rows, single_rows = read_csv(written[0]), read_csv(single_process_csv)
    assert [[row[0], *row[1::2]] for row in ddp_rows] == [[row[0], *row[1::2]] for row in single_rows]  # paths, names
    for ddp_row, single_row in zip(ddp_rows[1:], single_rows[1:]):
        assert [float(p) for p in ddp_row[2::2]] == pytest.approx([float(p) for p in single_row[2::2]], abs=2e-6)


NOT_UTF8 = os.fsdecode(b"caf\xe9.jpg")  # Latin-1 bytes: a legal Linux name that is not UTF-8
ODD_NAME = 'comma, "quote"\nnew line.png'  # CSV's special characters, all in one name
# Every image file of wild_folder, relative to it, in sorted path order; each exactly once.
READABLE = ["UPPER.JPG", "a.jpg", NOT_UTF8, "deep/er/still/x.jpeg", "folder.jpg/inner.png", "outside.jpg", ODD_NAME,
            "ünïcode.png"]
UNREADABLE = ["corrupt.jpg", "gone.jpg"]  # bad bytes; a dangling symlink


def wild_folder(parent: Path, jpeg: Path, *, unreadable: bool) -> Path:
    """A folder as users have them: odd names, symlink loops and duplicates, hidden and non-image files, a FIFO."""
    root = parent / "wild"
    (root / "deep" / "er" / "still").mkdir(parents=True)
    image = jpeg.read_bytes()
    for name in ["a.jpg", "UPPER.JPG", "deep/er/still/x.jpeg", ".hidden.jpg", "._a.jpg", ".cache/c.jpg"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(image)
    with Image.open(jpeg) as decoded:  # PNGs under names only some encodings and CSV readers survive
        for name in [NOT_UTF8, ODD_NAME, "ünïcode.png", "folder.jpg/inner.png"]:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            decoded.save(root / name, format="PNG")
    (root / "notes.txt").write_text("not an image")
    (root / "model.ckpt").write_bytes(b"not an image either")
    os.mkfifo(root / "pipe.jpg")  # opening it would block forever
    (root / "loop").symlink_to(".")  # a link back to the root
    (root / "deep" / "er" / "up").symlink_to("../..")  # a loop from below
    (root / "mirror").symlink_to("deep")  # a second path to a folder already walked
    (root / "alias.jpg").symlink_to("a.jpg")  # a second path to a file
    os.link(root / "a.jpg", root / "hard.jpg")  # a second name for the same file
    (parent / "elsewhere").mkdir()
    (parent / "elsewhere" / "o.jpg").write_bytes(image)
    (root / "outside.jpg").symlink_to(parent / "elsewhere" / "o.jpg")  # followed out of the root
    if unreadable:
        (root / "corrupt.jpg").write_bytes(image[: len(image) // 3])
        (root / "gone.jpg").symlink_to("deleted.jpg")
    return root


def relative(paths, root: Path) -> list[str]:
    return [Path(path).relative_to(root).as_posix() for path in paths]


def test_predict_lists_every_image_file_once_whatever_the_folder_holds(tiny_root, tmp_path):
    jpeg = sorted((tiny_root / "val" / "cat").glob("*.jpg"))[0]
    root = wild_folder(tmp_path, jpeg, unreadable=True)
    paths = list_images(root)
    assert relative(paths, root) == sorted(READABLE + UNREADABLE, key=lambda p: p)  # sorted as POSIX strings
    assert os.fsencode(paths[relative(paths, root).index(NOT_UTF8)]).endswith(b"/caf\xe9.jpg")  # the name's bytes


def test_predict_reads_each_listed_image_or_names_the_unreadable_ones_per_on_corrupt(tiny_root, tmp_path):
    jpeg = sorted((tiny_root / "val" / "cat").glob("*.jpg"))[0]
    root = wild_folder(tmp_path, jpeg, unreadable=True)
    strict, lenient = ImagePathDataset(root), ImagePathDataset(root, on_corrupt="skip")
    names = relative(strict.paths, root)
    for index, name in enumerate(names):
        if name in UNREADABLE:
            with pytest.raises(UnreadableImageError, match=re.escape(str(root / name)) + r".*data.on_corrupt=skip"):
                strict[index]
            assert lenient[index] is None
        else:
            image, got = strict[index]
            assert got == index and image.dtype == torch.uint8 and image.shape[0] == 3
    assert lenient.skipped == 2


def test_predict_root_holding_only_hidden_images_says_they_are_skipped(tmp_path):
    (tmp_path / "only_hidden" / ".thumbnails").mkdir(parents=True)
    (tmp_path / "only_hidden" / ".thumbnails" / "x.jpg").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="holds no images.*names starting with '.' are skipped"):
        list_images(tmp_path / "only_hidden")


@pytest.mark.slow  # the CLI in-process (its checkpoint fixture fits): ~3 s
def test_predict_of_a_wild_folder_writes_every_image_once_and_the_csv_paths_open(
    tiny_root, checkpoint, tmp_path, monkeypatch, capsys
):
    jpeg = sorted((tiny_root / "val" / "cat").glob("*.jpg"))[0]
    root = wild_folder(tmp_path, jpeg, unreadable=False)
    out = tmp_path / "out" / "predictions.csv"
    code, _, err = project_in_process(["predict", *tiny_args(tiny_root, tmp_path / "run"), f"--ckpt_path={checkpoint}",
                                       f"--data.predict_root={root}", f"--predictions.output={out}"], monkeypatch,
                                      capsys)
    assert code == 0, err[-3000:]
    header, *rows = read_csv(out)
    assert relative([row[0] for row in rows], root) == sorted(READABLE)
    for row in rows:  # every path read back opens as written, the name that is not UTF-8 included
        with open(row[0], "rb") as file:
            assert file.read(2) in (b"\xff\xd8", b"\x89P")  # JPEG, PNG
        assert row[1::2] and all(0 <= float(p) <= 1 for p in row[2::2])
    assert b"/caf\xe9.jpg," in out.read_bytes()  # the name's own bytes, not an escape
    assert not [p for p in out.parent.iterdir() if p != out]  # no temp or probe file left beside it


# The real process of this file's error cases: the interpreter's exit code and stderr, the whole entry point
# (project/__main__.py). The other cases run the same entry point in-process (project_in_process).
@pytest.mark.slow  # a CLI process: ~8 s
def test_predict_with_on_corrupt_error_stops_with_one_line_naming_the_unreadable_file(tiny_root, checkpoint, tmp_path):
    jpeg = sorted((tiny_root / "val" / "cat").glob("*.jpg"))[0]
    root = wild_folder(tmp_path, jpeg, unreadable=True)
    out = tmp_path / "predictions.csv"
    result = run_project(["predict", *tiny_args(tiny_root, tmp_path / "run"), f"--ckpt_path={checkpoint}",
                          f"--data.predict_root={root}", f"--predictions.output={out}"])
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot decode ") and str(root / "corrupt.jpg") in last, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not out.exists()


@pytest.mark.slow  # the CLI in-process (its checkpoint fixture fits): ~3 s
def test_predict_with_on_corrupt_skip_writes_the_others_and_names_the_skipped(tiny_root, checkpoint, tmp_path,
                                                                               monkeypatch, capsys):
    jpeg = sorted((tiny_root / "val" / "cat").glob("*.jpg"))[0]
    root = wild_folder(tmp_path, jpeg, unreadable=True)
    out = tmp_path / "predictions.csv"
    with warnings.catch_warnings(record=True) as caught:  # rank_zero_warn: the process prints them on stderr
        warnings.simplefilter("always")
        code, _, err = project_in_process(["predict", *tiny_args(tiny_root, tmp_path / "run"),
                                           f"--ckpt_path={checkpoint}",
                                           f"--data.predict_root={root}", f"--predictions.output={out}",
                                           "--data.on_corrupt=skip"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert relative([row[0] for row in read_csv(out)[1:]], root) == sorted(READABLE)
    warned = "\n".join(str(w.message) for w in caught)
    warning = re.search(r"predicted 8 of 10 images; not in the CSV: (.*) \(unreadable", warned)
    assert warning and warning.group(1) == f"{root / 'corrupt.jpg'}, {root / 'gone.jpg'}", warned[-3000:]


@pytest.mark.slow  # the CLI in-process (its checkpoint fixture fits): ~1 s
def test_an_unwritable_predictions_output_fails_before_any_image_is_predicted(tiny_root, checkpoint, tmp_path,
                                                                               monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "predictions.csv"  # its folder would have to be a file
    code, stdout, stderr = project_in_process(["predict", *tiny_args(tiny_root, tmp_path / "run"),
                                               f"--ckpt_path={checkpoint}", f"--predictions.output={out}",
                                               "--trainer.enable_progress_bar=true"], monkeypatch, capsys)
    assert code == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write the predictions to {out} (") and "--predictions.output" in last
    # The progress bar never started (in-process, tqdm writes to the sys.stdout capsys captures: it would show).
    assert "Predicting DataLoader" not in stderr + stdout


@pytest.mark.slow  # the CLI in-process on a full disk (its checkpoint fixture fits): ~3 s
def test_predictions_that_find_the_disk_full_are_written_to_tmpdir_and_the_error_says_where(
    tiny_root, checkpoint, image_folder, tmp_path, tmpfs, monkeypatch, capsys
):
    disk = tmpfs("64k")
    out = disk / "predictions.csv"
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as file:  # fill the disk: the probe (an empty file) passes, the CSV cannot
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError:
            pass
    rescue_dir = tmp_path / "tmp"
    rescue_dir.mkdir()
    # TMPDIR=rescue_dir as for a process: tempfile reads it once and caches the answer (tempfile.tempdir), which the
    # rescue (tempfile.gettempdir(), classifier_engine/callbacks/prediction_writer.py) then returns; both restored
    # after.
    monkeypatch.setenv("TMPDIR", str(rescue_dir))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert tempfile.gettempdir() == str(rescue_dir)
    # A link planted at the rescue's temp name (guessable in a shared $TMPDIR): not written through.
    from classifier_engine.storage.files import partial_path

    victim = tmp_path / "victim"
    victim.write_text("the user's file")
    partial_path(rescue_dir / f"predictions.{os.getpid()}.csv").symlink_to(victim)
    code, _, stderr = project_in_process(["predict", *tiny_args(tiny_root, tmp_path / "run"),
                                          f"--ckpt_path={checkpoint}",
                                          f"--data.predict_root={image_folder}", f"--predictions.output={out}"],
                                         monkeypatch, capsys)
    assert code == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    (rescued,) = rescue_dir.glob("predictions.*.csv")
    assert last == (f"error: could not write {out} (no space left on the device); the predictions for 17 images were "
                    f"written to {rescued} instead: move that file where you want it (or fix the cause and predict "
                    "again)")
    assert [row[0] for row in read_csv(rescued)[1:]] == [str(path) for path in list_images(image_folder)]
    assert not out.exists() and sorted(p.name for p in disk.iterdir()) == ["filler"]
    assert victim.read_text() == "the user's file" and sorted(p.name for p in rescue_dir.iterdir()) == [rescued.name]


def test_predictions_images_with_an_image_folder_module_predicts_that_folder(tiny_root, checkpoint, tmp_path):
    # Issue 45, item 6: the module's own predict set (its val split, 17 images here) was predicted and the folder
    # given by --predictions.images ignored without a word. The plan gives the folder to the module's predict_root.
    folder = tmp_path / "three"
    folder.mkdir()
    for source in sorted((tiny_root / "val" / "cat").glob("*.jpg"))[:3]:
        shutil.copy(source, folder / source.name)
    out = tmp_path / "predictions.csv"
    cli = cli_main(["predict", *tiny_args(tiny_root, tmp_path / "run", "--data.class_path=classifier_engine.data."
                                          "ImageFolderDataModule", f"--data.root={tiny_root}"),
                    f"--ckpt_path={checkpoint}", f"--predictions.images={folder}", f"--predictions.output={out}"])
    assert [row[0] for row in read_csv(out)[1:]] == [str(path) for path in sorted(folder.glob("*.jpg"))]
    assert cli.started.plan.value("predict set") == str(folder)


def test_predictions_images_beside_a_modules_own_predict_set_is_refused_in_one_line(tiny_root, tmp_path, monkeypatch,
                                                                                     capsys):
    # A data module that makes its own predict set and takes no folder: the option would be ignored.
    (tmp_path / "own_set.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "from classifier_engine.data import ImageFolderDataModule\n\n"
        "class Own(ImageFolderDataModule):\n"
        "    def __init__(self, root: str = '', batch_size: int = 8):\n"
        "        super().__init__(root=root, batch_size=batch_size)\n\n"
        "    def predict_dataloader(self):\n"
        "        return DataLoader(TensorDataset(torch.zeros(2, 3, 8, 8)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = tiny_args(tiny_root, tmp_path / "run", "--data.class_path=own_set.Own", f"--data.root={tiny_root}")
    code, _, err = project_in_process(["predict", *args, f"--predictions.images={tmp_path}"], monkeypatch, capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, f"error: --predictions.images {tmp_path}: data module "
                                                       "own_set.Own makes its own predict set (predict_dataloader) and "
                                                       "takes no predict_root; drop --predictions.images")
