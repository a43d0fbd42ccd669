"""quern prepare of image folders (prepare/images.py): labels from the class folders, width and height
metadata, images shrunk to --max-side once; and ArrayRecordSource(fields=...) reading the labels back."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from helpers import assert_same_pipeline, prepare_cli, write_config
from PIL import Image

import quern
from quern.prepare import prepare
from quern.transforms import image

SIZES = {"cat": [(60, 40), (300, 200)], "dog": [(50, 80)], "emu": [(90, 90), (40, 30)]}  # (width, height)


def _tree(root):
    """An ImageNet-style tree: CLASS/NNN.{jpg,png}, JPEG and PNG, grey and RGBA among them."""
    for k, (cls, sizes) in enumerate(SIZES.items()):
        (root / cls).mkdir(parents=True)
        for i, (w, h) in enumerate(sizes):
            y, x = np.mgrid[0:h, 0:w]
            px = np.stack([(x * 2 + 40 * k) % 256, (y * 3) % 256, (x + y + 9 * i) % 256], axis=2).astype(np.uint8)
            img = Image.fromarray(px)
            if cls == "emu" and i == 1:
                img.convert("RGBA").save(root / cls / f"{i:03d}.png")
            elif cls == "dog":
                img.convert("L").save(root / cls / f"{i:03d}.jpg", quality=90)
            else:
                img.save(root / cls / f"{i:03d}.jpg", quality=90)
    return root


def test_labels_width_and_height_from_an_image_tree(tmp_path):
    tree = _tree(tmp_path / "train")
    m = prepare(tree, tmp_path / "out", labels_from_dirs=True, num_workers=0, progress=False)
    assert m["options"]["images"] == {"labels_from_dirs": True, "max_side": None, "classes": ["cat", "dog", "emu"]}
    src = quern.sources.ArrayRecordSource(str(tmp_path / "out"), fields=("label", "width", "height"))
    recs = src.read_many(np.arange(len(src)))
    names = [f"{c}/{i:03d}" for c in SIZES for i in range(len(SIZES[c]))]  # the files in path order
    want = [(["cat", "dog", "emu"].index(n.split("/")[0]), *SIZES[n.split("/")[0]][int(n[-3:])]) for n in names]
    assert [(int(r["label"]), int(r["width"]), int(r["height"])) for r in recs] == want
    for r, n in zip(recs, names):
        path = tree / (n + (".png" if n == "emu/001" else ".jpg"))
        assert r["bytes"] == path.read_bytes()  # stored as they are
        assert image.decode()(r["bytes"]).shape[:2] == (int(r["height"]), int(r["width"]))


def test_max_side_shrinks_larger_images_once(tmp_path):
    tree = _tree(tmp_path / "train")
    m = prepare(tree, tmp_path / "out", labels_from_dirs=True, max_side=64, num_workers=0, progress=False)
    assert m["options"]["images"]["max_side"] == 64 and "Lanczos" in m["options"]["images"]["shrunk"]
    src = quern.sources.ArrayRecordSource(str(tmp_path / "out"), fields=("width", "height"))
    got = {(int(r["width"]), int(r["height"])): r["bytes"] for r in src.read_many(np.arange(len(src)))}
    assert sorted(got) == sorted([(64, 43), (40, 30), (60, 40), (40, 64), (64, 64)])  # 300x200 -> 64x43, ...
    small = (tree / "cat" / "000.jpg").read_bytes()
    assert got[(60, 40)] == small  # under max_side: untouched
    shrunk = image.decode(None)(got[(64, 43)])
    assert shrunk.shape == (43, 64, 3)
    ref = io.BytesIO()  # what the manifest says: Pillow's Lanczos, aspect kept, JPEG at quality 95
    Image.open(tree / "cat" / "001.jpg").convert("RGB").resize((64, 43), Image.Resampling.LANCZOS).save(
        ref, "JPEG", quality=95
    )
    assert got[(64, 43)] == ref.getvalue()
    assert image.decode(None)(got[(40, 64)]).shape == (64, 40, 1)  # grey stays grey (JPEG)
    assert image.decode(None)(got[(64, 64)]).shape == (64, 64, 3)


def test_a_training_pipeline_reads_images_and_labels_and_has_a_config_form(tmp_path):
    prepare(_tree(tmp_path / "train"), tmp_path / "out", labels_from_dirs=True, num_workers=0, progress=False)
    src = quern.sources.ArrayRecordSource(str(tmp_path / "out"), fields=["label"])
    pipe = (
        quern.Pipeline.from_source(src, seed=1)
        .shuffle()
        .map(image.decode(key="bytes"))
        .random_map(image.random_resized_crop(16, key="bytes"))
        .batch(5)
    )
    batch = pipe.batch_at(3)
    assert batch["bytes"].shape == (5, 16, 16, 3) and batch["label"].dtype == np.int64
    cfg = pipe.to_config()
    assert cfg["source"]["fields"] == ["label"]
    assert_same_pipeline(pipe, quern.load_config(write_config(tmp_path, cfg)), (0, 3, 11))
    plain = quern.Pipeline.from_source(quern.sources.ArrayRecordSource(str(tmp_path / "out")), seed=1)
    assert plain.fingerprint() != quern.Pipeline.from_source(src, seed=1).fingerprint()


def test_the_command_line(tmp_path, capsys):
    tree = _tree(tmp_path / "train")
    status, out, err = prepare_cli(
        capsys, tree, "-o", tmp_path / "out", "--labels-from-dirs", "--max-side", "64", "--workers", "0"
    )
    assert status == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["options"]["images"]["classes"] == ["cat", "dog", "emu"]
    assert sorted(manifest["metadata"]) == ["height", "label", "length", "width"]


def test_bad_input(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "a.jpg")
    with pytest.raises(ValueError, match="needs class folders"):
        prepare(flat, tmp_path / "o1", labels_from_dirs=True, num_workers=0, progress=False)
    with pytest.raises(ValueError, match="max_side must be a positive int"):
        prepare(flat, tmp_path / "o2", max_side=0, num_workers=0, progress=False)
    with pytest.raises(ValueError, match="leave map out"):
        prepare(flat, tmp_path / "o3", max_side=4, map=lambda r: r, num_workers=0, progress=False)
    tree = _tree(tmp_path / "train")
    (tree / "cat" / "notes.txt").write_text("not an image")
    with pytest.raises(quern.PrepareError, match=r"notes.txt.*not a JPEG or PNG"):
        prepare(tree, tmp_path / "o4", labels_from_dirs=True, num_workers=0, progress=False)
    m = prepare(tree, tmp_path / "o5", labels_from_dirs=True, skip_errors=True, num_workers=0, progress=False)
    assert m["skipped"]["count"] == 1 and m["records"]["count"] == 5
    with pytest.raises(quern.SourceError, match="no metadata field 'colour'"):
        quern.sources.ArrayRecordSource(str(tmp_path / "o5"), fields=["colour"])
    with pytest.raises(TypeError, match="fields must be a list of field names, got the string 'label'"):
        quern.sources.ArrayRecordSource(str(tmp_path / "o5"), fields="label")


def test_a_cmyk_jpeg_shrunk_stays_its_colours(tmp_path):
    (tmp_path / "train" / "red").mkdir(parents=True)
    Image.new("RGB", (200, 100), (220, 20, 20)).convert("CMYK").save(tmp_path / "train" / "red" / "0.jpg")
    prepare(tmp_path / "train", tmp_path / "out", max_side=50, num_workers=0, progress=False)
    src = quern.sources.ArrayRecordSource(str(tmp_path / "out"))
    shrunk = image.decode()(src.read_many(np.arange(1))[0])
    assert shrunk.shape == (25, 50, 3)
    assert np.abs(shrunk.reshape(-1, 3).mean(0) - [220, 20, 20]).max() < 12  # red, not a black frame
