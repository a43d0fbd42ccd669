"""Images decoded and augmented to 224x224: images/s of quern, grain and PyTorch, and the decoder's limit.

The same JPEG files (``--images`` of 400-800 px a side, quality 90, smooth with a little
noise, made here) and the same augmentation: decode to RGB, a random resized crop to
224x224 (scale 0.08-1, torchvision's draw, bilinear), a random left-right flip, and a
float32 normalisation with ImageNet's mean and std; batches of 32.

* **the limit**: libjpeg-turbo's decode alone (``simplejpeg``, quern's decoder) in images/s
  on one core, times the cores; and Pillow's decode alone, for comparison. Then the work
  alone: the crop from the bytes, the flip and the normalisation of each image in a plain
  loop on one core (no pipeline), times the cores: what the augmentations leave of the limit.
* **quern**: ``decode / random_resized_crop / random_flip``, then ``batch`` and
  ``normalize`` on the whole batch (``map_batch``), over an ArrayRecord file, ``iterator()`` with 0 workers, 2 worker processes, and 2 threads;
  and with the crop and flip on the device (the host decodes and resizes to 256x256,
  ``random_map_device`` crops on JAX's CPU device here) through ``global_iterator``;
  and with the crop taking the bytes (decode and crop in one: a JPEG decoded at the
  smallest DCT scale that keeps the box at least 224x224).
* **grain**: PIL in a per-record ``map`` (``Image.open``, the same crop box, ``resize``
  with a box, flip, normalise), ``MapDataset`` over the same file, in the calling thread
  and with ``mp_prefetch(num_workers=2)``.
* **tf.data**: TensorFlow's own ImageNet recipe over the same JPEGs as files:
  ``sample_distorted_bounding_box`` from the header (the same scale and ratio),
  ``decode_and_crop_jpeg`` (only the box's window decoded), ``resize`` (bilinear,
  antialiased), ``random_flip_left_right``, normalise; ``map(num_parallel_calls=AUTOTUNE)``,
  ``batch(32)``, ``prefetch``; run by ``--tf-python`` (a Python with tensorflow-cpu),
  or left out, and said.
* **PyTorch**: ``DataLoader(num_workers=2, batch_size=32)`` over the same JPEGs as files
  with ``torchvision.io.decode_jpeg`` and ``transforms.v2`` (``RandomResizedCrop(224,
  antialias=True)``, ``RandomHorizontalFlip``, ``ToDtype``, ``Normalize``), run by
  ``--torch-python`` (a Python with torch and torchvision) when given, or this one if it
  has them; otherwise left out, and said.

Each config: a fresh iterator, 2 batches untimed, then at least ``--min-seconds``;
``--runs`` rounds, configs in turn; the median.

Run:  python benchmarks/vision.py  [--images 800] [--runs 3] [--min-seconds 3] [--torch-python PATH] [--tf-python PATH]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import quern  # noqa: E402
from quern.transforms import image  # noqa: E402

BATCH = 32
SIZE = 224
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs of 400-800 px a side at quality 90: smooth gradients with a little noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(400, 801, 2))
        y, x = np.mgrid[0:h, 0:w]
        px = np.stack([(x * 0.7 + i) % 256, (y * 0.5) % 256, ((x + y) * 0.2) % 256], axis=2)
        px = np.clip(px + rng.integers(-8, 9, px.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def quern_pipeline(path: str, device: bool = False, fused: bool = False) -> quern.Pipeline:
    src = quern.sources.ArrayRecordSource(path, name="jpegs")
    pipe = quern.Pipeline.from_source(src, seed=0).shuffle()
    if fused:  # the crop takes the bytes: decoded at the smallest DCT scale that keeps the box >= 224
        pipe = pipe.random_map(image.random_resized_crop(SIZE)).random_map(image.random_flip())
        return pipe.batch(BATCH).map_batch(image.normalize(MEAN, STD))
    pipe = pipe.map(image.decode())
    if device:
        from quern.transforms.image import device as on_device

        pipe = pipe.map(image.resize((256, 256))).batch(BATCH)
        return pipe.random_map_device(on_device.random_resized_crop(SIZE)).random_map_device(on_device.random_flip())
    pipe = pipe.random_map(image.random_resized_crop(SIZE)).random_map(image.random_flip())
    return pipe.batch(BATCH).map_batch(image.normalize(MEAN, STD))  # uint8 rows collate 4x lighter


class PilAugment:
    """What a grain user writes: PIL per record, the crop box drawn with numpy from a per-record generator."""

    def __call__(self, record: bytes, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image

        from quern.transforms.image.geometry import resized_crop_box

        img = Image.open(io.BytesIO(record)).convert("RGB")
        top, left, h, w = resized_crop_box(rng, img.size[1], img.size[0], (0.08, 1.0), (3 / 4, 4 / 3))
        img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return ((np.asarray(img, dtype=np.float32) - MEAN) / STD).astype(np.float32)


def grain_iterator(path: str, workers: int) -> Any:
    import grain

    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([path])).shuffle(seed=0).repeat()
    ds = ds.random_map(PilAugment(), seed=0).batch(BATCH)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    if workers:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(it)


TF_CHILD = r"""
import json, os, sys, time, glob
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
folder, min_seconds, runs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
files = sorted(glob.glob(folder + "/*.jpg"))
MEAN, STD = tf.constant([123.675, 116.28, 103.53]), tf.constant([58.395, 57.12, 57.375])
WHOLE = tf.constant([[[0.0, 0.0, 1.0, 1.0]]])
def augment(path):  # TF's own ImageNet recipe: the box from the header, only its window decoded
    data = tf.io.read_file(path)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.io.extract_jpeg_shape(data), bounding_boxes=WHOLE, area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    img = tf.image.decode_and_crop_jpeg(data, tf.stack([y, x, h, w]), channels=3)
    img = tf.image.resize(img, [224, 224], method="bilinear", antialias=True)
    return (tf.image.random_flip_left_right(img) - MEAN) / STD
rates = []
for _ in range(runs):
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files)).repeat()
    it = iter(ds.map(augment, num_parallel_calls=tf.data.AUTOTUNE).batch(32).prefetch(tf.data.AUTOTUNE))
    next(it); next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        n += next(it).shape[0]
    rates.append(n / (time.perf_counter() - t0))
    del it, ds
print(json.dumps({"rates": rates, "tensorflow": tf.__version__}))
"""


TORCH_CHILD = r"""
import json, sys, time, glob
import torch, torchvision
from torchvision.io import decode_jpeg, read_file
from torchvision.transforms import v2
folder, min_seconds, runs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
files = sorted(glob.glob(folder + "/*.jpg"))
aug = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                  v2.ToDtype(torch.float32, scale=False),
                  v2.Normalize(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])])
class Images(torch.utils.data.Dataset):
    def __len__(self): return len(files)
    def __getitem__(self, i): return aug(decode_jpeg(read_file(files[i])))
rates = []
for _ in range(runs):
    loader = torch.utils.data.DataLoader(Images(), batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
    it = iter(loader); next(it); next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader); b = next(it)
        n += b.shape[0]
    rates.append(n / (time.perf_counter() - t0))
    del it, loader
print(json.dumps({"rates": rates, "torch": torch.__version__, "torchvision": torchvision.__version__}))
"""


def decode_rate(files: list[bytes], decode: Any, min_seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        for f in files:
            decode(f)
            n += 1
    return n / (time.perf_counter() - t0)


def _child(python: str, script: str, folder: str, args: Any) -> dict[str, Any]:
    """The JSON a peer's script (run by ``python`` over the JPEG folder) prints last."""
    child = subprocess.run(
        [python, "-c", script, folder, str(args.min_seconds), str(args.runs)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if child.returncode:
        raise RuntimeError(child.stderr.strip().splitlines()[-1] if child.stderr.strip() else "failed")
    return __import__("json").loads(child.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def work_rate(files: list[bytes], min_seconds: float) -> float:
    """Images/s on one core of the fused pipeline's own work, nothing else: for each image the random crop
    from the bytes (decode at a DCT scale and resize), the flip, and its share of the normalisation (the
    image normalised alone), with a generator of this loop's own."""
    crop, flip, norm = image.random_resized_crop(SIZE), image.random_flip(), image.normalize(MEAN, STD)
    rng = np.random.default_rng(0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        for f in files:
            norm(np.ascontiguousarray(flip(crop(f, rng), rng)))  # the batch is made contiguous when collated
            n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=800)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with torch and torchvision")
    ap.add_argument("--tf-python", default=sys.executable, help="a Python with tensorflow (tensorflow-cpu)")
    args = common.parse_args(ap)
    assert args is not None
    import grain
    import simplejpeg
    from PIL import Image

    common.grain_flags()
    started = common.begin(grain=getattr(grain, "__version__", "?"), simplejpeg=simplejpeg.__version__)
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="quern-vision-") as tmp:
        files = make_jpegs(args.images)
        path = os.path.join(tmp, "images.array_record")
        common.write_array_record(path, files)
        folder = os.path.join(tmp, "jpg")
        os.makedirs(folder)
        for i, f in enumerate(files):
            with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as out:
                out.write(f)
        mb = sum(map(len, files)) / 1e6
        print(f"{len(files)} JPEGs, {mb:.1f} MB, 400-800 px a side, quality 90; batches of {BATCH} at {SIZE}x{SIZE}")

        limit = {
            "libjpeg-turbo (simplejpeg)": decode_rate(
                files, lambda f: simplejpeg.decode_jpeg(f, colorspace="RGB"), args.min_seconds
            ),
            "Pillow": decode_rate(
                files, lambda f: np.asarray(Image.open(io.BytesIO(f)).convert("RGB")), args.min_seconds
            ),
        }
        for name, r in limit.items():
            print(f"decode alone, one core, {name}: {r:,.0f} images/s; x {cpus} cores = {r * cpus:,.0f}")
        bound = limit["libjpeg-turbo (simplejpeg)"] * cpus
        work = work_rate(files, args.min_seconds)
        print(
            f"the crop from the bytes, flip and normalisation alone, one core: {work:,.0f} images/s; "
            f"x {cpus} cores = {work * cpus:,.0f} ({work * cpus / bound:.0%} of the limit)"
        )

        mesh = None

        def quern_case(workers: int, threads: int = 1, device: bool = False, fused: bool = False) -> Any:
            def run() -> float:
                nonlocal mesh
                pipe = quern_pipeline(path, device, fused)
                if device:
                    import jax

                    mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
                    it = quern.sharding.global_iterator(pipe, mesh, num_workers=workers)

                    def one() -> Any:
                        batch = next(it)
                        jax.block_until_ready(batch)
                        return batch

                else:
                    it = common.started(pipe.iterator(num_workers=workers, num_threads=threads))
                    one = it.__next__
                one()
                one()
                r = common.rate(one, args.min_seconds) * BATCH
                common.close(it)
                return r

            return run

        def grain_case(workers: int) -> Any:
            def run() -> float:
                it = grain_iterator(path, workers)
                next(it)
                next(it)
                r = common.rate(lambda: next(it), args.min_seconds) * BATCH
                common.close(it)
                return r

            return run

        cases = [
            ("quern, 0 workers", quern_case(0)),
            ("quern, 2 threads", quern_case(0, threads=2)),
            ("quern, 2 workers", quern_case(2)),
            ("quern, 2 threads, crop from the bytes", quern_case(0, threads=2, fused=True)),
            ("quern, 2 workers, crop from the bytes", quern_case(2, fused=True)),
            ("quern, 2 workers, crop and flip on the device (JAX CPU)", quern_case(2, device=True)),
            ("grain + PIL, MapDataset", grain_case(0)),
            ("grain + PIL, mp_prefetch 2 workers", grain_case(2)),
        ]
        errors: dict[str, str] = {}
        results = common.interleaved(cases, args.runs, alternate=True, errors=errors, progress=True)
        notes = []  # the peers' versions, or why one was not measured
        peers = [
            (
                "PyTorch DataLoader + torchvision v2, 2 workers",
                args.torch_python,
                TORCH_CHILD,
                ("torch", "torchvision"),
            ),
            ("tf.data, decode_and_crop_jpeg, AUTOTUNE", args.tf_python, TF_CHILD, ("tensorflow",)),
        ]
        for name, python, script, versions in peers:
            try:
                got = _child(python, script, folder, args)
                results[name] = got["rates"]
                notes.append(", ".join(f"{v} {got[v]}" for v in versions))
            except Exception as e:  # noqa: BLE001 - the peers are optional here
                notes.append(f"{name}: not measured: {common.error_line(e)}")
    header = ["config", "images/s", "of the limit", "runs"]
    rows = []
    for name, rates in results.items():
        if not rates:
            continue
        med = statistics.median(rates)
        rows.append([name, f"{med:,.0f}", f"{med / bound:.0%}", common.join_runs(rates)])
    common.print_table(header, rows)
    print()
    print(common.markdown_header(header))
    for row in rows:
        print(common.markdown_row(row))
    print()
    print(f"the limit: {bound:,.0f} images/s (libjpeg-turbo's decode alone x {cpus} cores)")
    print(f"the work alone (crop from the bytes, flip, normalise): {work * cpus:,.0f} images/s x {cpus} cores")
    print("\n".join(notes))
    for name, why in errors.items():
        print(f"{name}: FAILED: {why}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
