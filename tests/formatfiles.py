"""Reference files for the file sources: written by each format's own library, read back by it.

Tests of :class:`WebDatasetSource`, :class:`TFRecordSource` and :class:`JsonlSource` write their
files with these helpers and assert that quern reads exactly what the format's library reads:

- WebDataset: :func:`write_webdataset` (``webdataset.TarWriter``), :func:`read_webdataset` (the
  library's tar iterator and ``group_by_keys``, as ``webdataset.WebDataset`` chains them),
  :func:`make_webdataset_samples`;
- TFRecord: :func:`write_tfrecords` (raw records, the framing and CRCs of ``tfrecord.TFRecordWriter``),
  :func:`write_tfrecord_examples` (``tf.train.Example`` records), :func:`read_tfrecords`
  (``tfrecord.reader.tfrecord_iterator``), :func:`write_tfrecord_index` (``tfrecord2idx``),
  :func:`tfrecord_crc_errors`, :func:`make_tfrecord_payloads`;
- JSON lines: :func:`write_jsonl`, :func:`read_jsonl`, :func:`make_json_objects`;
- bad files: :func:`truncate`, :func:`flip_byte`, :func:`write_tar`,
  :func:`write_tar_with_extensionless_member`, :func:`gzip_copy`, :func:`write_tfrecords_cut_short`.

Facts the expectations rest on (webdataset 1.0.2, tfrecord 1.14.6):

- ``TarWriter`` writes one member ``key + "." + ext`` per entry, in ``sorted()`` order of the
  extensions, skipping entries whose name starts with ``_``; ``str`` values become UTF-8, ``bytes``
  pass unchanged except under an extension ending in ``.gz`` (gzip-compressed then), other values go
  through its handlers (``json`` -> ``json.dumps``, ``cls`` -> ``str(x)``). The tar is Python's default
  PAX format (its ``format=`` argument is not passed on); with the default ``mtime`` (a float,
  ``time.time()``) every member gets a preceding pax ``x`` header holding the mtime, with an ``int``
  mtime only names over 100 bytes or non-ASCII get one. It ends with two zero blocks, padded to a
  multiple of 10240 bytes.
- webdataset splits a name with ``^((?:.*/|)[^.]+)[.]([^/]*)$`` (key: up to the first dot of the last
  path component; extension: the rest, lower-cased), skips names without such a dot, non-regular
  members and ``__*__`` meta names, starts a new sample whenever the key differs from the previous
  member's (so a key seen earlier starts a new sample again) and raises ``ValueError`` on a repeated
  extension within one sample.
- ``tfrecord_iterator`` yields a ``memoryview`` into one reused buffer (copied here) and checks no CRC.

Libraries are imported where they are used, as in ``helpers``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import struct
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

StrPath = str | os.PathLike[str]
"""A file's path, as ``str`` or ``pathlib.Path``."""

WEBDATASET_META_KEYS = ("__url__", "__local_path__")
"""The entries webdataset adds to each sample besides ``__key__`` (``tar_file_expander``, ``group_by_keys``)."""

TAR_BLOCK = 512
TAR_RECORD = 10240  # tarfile.RECORDSIZE: a tar written by tarfile is padded to a multiple of it
TFRECORD_OVERHEAD = 16  # uint64 length + masked crc32c of it + masked crc32c of the data


# --- WebDataset ---------------------------------------------------------------------------------

# sizes that sit on and next to tar's 512-byte blocks and 10240-byte records
_EDGE_SIZES = (0, 1, 511, 512, 513, 1024, 1536, 4096, 10239, 10240, 10241, 20480, 65536, 102400, 100_000)


def make_webdataset_samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Varied WebDataset samples, as the webdataset library reads them back: bytes values.

    Every sample has ``"__key__"`` (``shard<k>/<6 digits>``; every 7th under a folder holding a dot,
    ``a.b/c/...``; sample 3 a key long enough for the member names to pass tar's 100 bytes, which
    puts a pax ``path`` header before them), ``jpg`` and ``cls``; ``json``, ``txt`` and the two-dot
    ``seg.png`` are missing from some samples (every 5th has no ``json``, every 3rd no ``seg.png``,
    every 4th no ``txt``). The ``jpg`` sizes go through :data:`_EDGE_SIZES` (0 bytes to ~100 KB, exact
    multiples of 512 and their neighbours), the other entries are small (``txt`` may be empty).

    Args:
        n: How many samples.
        seed: Seed of the contents.

    Returns:
        The samples: ``"__key__"`` -> ``str``, each extension -> ``bytes``, extensions lower-case.
    """
    rng = random.Random(seed)
    samples: list[dict[str, Any]] = []
    for i in range(n):
        folder = f"shard{i // 50}"
        if i % 7 == 6:
            folder = f"a.b/c{i // 50}"
        key = f"{folder}/{i:06d}"
        if i == 3:
            key = f"{folder}/{'long' * 25}_{i:06d}"
        jpg_size = _EDGE_SIZES[i % len(_EDGE_SIZES)] if i < 2 * len(_EDGE_SIZES) else rng.randrange(0, 100_000)
        sample: dict[str, Any] = {
            "__key__": key,
            "jpg": b"\xff\xd8\xff" + rng.randbytes(jpg_size - 3) if jpg_size >= 3 else rng.randbytes(jpg_size),
            "cls": str(rng.randrange(1000)).encode("ascii"),
        }
        if i % 5 != 4:
            sample["json"] = json.dumps({"i": i, "caption": f"échantillon {i}", "tags": ["a", "b"][: i % 3]}).encode()
        if i % 4 != 3:
            sample["txt"] = ("texte ✓ " * rng.randrange(0, 40)).encode("utf-8")
        if i % 3 != 2:
            sample["seg.png"] = b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.choice((0, 504, 1016, rng.randrange(3000))))
        samples.append(sample)
    return samples


def write_webdataset(
    path: StrPath,
    samples: Iterable[Mapping[str, Any]],
    *,
    mtime: float | None = None,
    encoder: bool = True,
) -> None:
    """Write samples to one tar shard with ``webdataset.TarWriter``.

    Args:
        path: The tar file to write (a name ending in ``gz`` makes ``TarWriter`` gzip it).
        samples: Dicts with ``"__key__"`` and extension -> value; with ``encoder=True`` a value is
            ``bytes`` (written as is, except under an extension ending in ``.gz``: gzip-compressed),
            ``str`` (UTF-8) or what ``TarWriter``'s handler for the extension takes (``json``: any
            JSON value, ``cls``: an int...).
        mtime: Members' mtime; ``None`` is ``TarWriter``'s default, ``time.time()``, a float, which
            gives every member a pax header; an ``int`` gives plain ustar headers (bar long names).
        encoder: ``TarWriter``'s ``encoder``: ``False`` writes bytes values only, unchanged.

    Raises:
        ValueError: From ``TarWriter``: a sample without ``"__key__"`` or a value it cannot encode.
    """
    import webdataset

    with webdataset.TarWriter(os.fspath(path), mtime=mtime, encoder=encoder) as writer:
        for sample in samples:
            writer.write(dict(sample))


def read_webdataset(path: StrPath, *, via_dataset: bool = False) -> list[dict[str, Any]]:
    """The samples of one tar shard as the webdataset library reads them.

    By default the library's own stages are chained the way ``webdataset.WebDataset`` chains them
    for a local file (``cache.StreamingOpen``'s ``{"url", "stream", "local_path"}``, then
    ``tariterators.tar_file_expander``, then ``tariterators.group_by_keys``), without its node and
    worker splitting (which reads ``RANK``/``WORLD_SIZE``/``WORKER``/``NUM_WORKERS``) and its
    empty-dataset check.

    Args:
        path: The tar file (gzip-compressed too: the library opens tars with mode ``"r|*"``).
        via_dataset: Read through ``webdataset.WebDataset(path, shardshuffle=False,
            empty_check=False)`` instead.

    Returns:
        One dict per sample, in tar order: ``"__key__"`` and extension -> ``bytes``, without the
        entries of :data:`WEBDATASET_META_KEYS`.

    Raises:
        ValueError: A repeated extension within one sample (webdataset's error).
        tarfile.ReadError: A tar cut inside a member's data, or unreadable from its first header.
    """
    from webdataset import tariterators

    name = os.fspath(path)
    if via_dataset:
        import webdataset

        samples = list(webdataset.WebDataset(name, shardshuffle=False, empty_check=False))
    else:
        with open(name, "rb") as stream:
            source = {"url": name, "stream": stream, "local_path": name}
            samples = list(tariterators.group_by_keys(tariterators.tar_file_expander([source])))
    return [{k: v for k, v in sample.items() if k not in WEBDATASET_META_KEYS} for sample in samples]


def write_tar(path: StrPath, members: Sequence[tuple[str, bytes | None]], *, fmt: int = tarfile.PAX_FORMAT) -> None:
    """Write a tar with the stdlib ``tarfile``, member by member, for the cases ``TarWriter`` cannot make.

    Args:
        path: The tar file to write.
        members: ``(name, data)`` in order; ``data`` ``None`` writes a directory entry.
        fmt: ``tarfile.USTAR_FORMAT``, ``GNU_FORMAT`` or ``PAX_FORMAT``.
    """
    with tarfile.open(os.fspath(path), "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = 0
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o444
                tar.addfile(info, io.BytesIO(data))


def write_tar_with_extensionless_member(path: StrPath, name: str = "README") -> list[dict[str, Any]]:
    """Write a tar holding a member without extension (``name``) between two members of one sample.

    Args:
        path: The tar file to write.
        name: The member without a dot in its last path component.

    Returns:
        The samples as the webdataset library reads them: it skips the member, and the sample
        around it stays one sample.
    """
    write_tar(
        path,
        [
            ("s/000000.txt", b"zero"),
            (name, b"no extension here"),
            ("s/000000.json", b"{}"),
            ("s/000001.txt", b"one"),
        ],
    )
    return [{"__key__": "s/000000", "txt": b"zero", "json": b"{}"}, {"__key__": "s/000001", "txt": b"one"}]


# --- TFRecord -----------------------------------------------------------------------------------

_TFRECORD_EDGE_SIZES = (0, 1, 7, 8, 12, 16, 511, 512, 4095, 4096, 16384, 50_000, 51_200)


def make_tfrecord_payloads(n: int, seed: int = 0) -> list[bytes]:
    """Raw TFRecord payloads of 0 bytes to ~50 KB (the first go through edge sizes, then random ones).

    Args:
        n: How many payloads.
        seed: Seed of the contents.

    Returns:
        The payloads.
    """
    rng = random.Random(seed)
    sizes = [
        _TFRECORD_EDGE_SIZES[i]
        if i < len(_TFRECORD_EDGE_SIZES)
        else rng.choice((rng.randrange(200), rng.randrange(51_200)))
        for i in range(n)
    ]
    return [rng.randbytes(size) for size in sizes]


def _tfrecord_frame(data: bytes) -> bytes:
    from tfrecord.writer import TFRecordWriter

    length = struct.pack("<Q", len(data))
    return length + TFRecordWriter.masked_crc(length) + bytes(data) + TFRecordWriter.masked_crc(data)


def write_tfrecords(path: StrPath, records: Iterable[bytes]) -> None:
    """Write raw records to a TFRecord file with the ``tfrecord`` package's writer.

    ``TFRecordWriter.write`` only takes ``tf.train.Example`` feature dicts, so each record goes
    through the writer's file with the framing of ``TFRecordWriter.write`` and its
    ``TFRecordWriter.masked_crc``: ``uint64`` length (little-endian), masked crc32c of those 8 bytes,
    the data, masked crc32c of the data.

    Args:
        path: The file to write.
        records: The records' bytes.
    """
    from tfrecord.writer import TFRecordWriter

    writer = TFRecordWriter(os.fspath(path))
    try:
        for data in records:
            writer.file.write(_tfrecord_frame(data))
    finally:
        writer.close()


def write_tfrecord_examples(path: StrPath, datums: Iterable[Mapping[str, tuple[Any, str]]]) -> list[bytes]:
    """Write ``tf.train.Example`` records with ``tfrecord.TFRecordWriter.write``.

    Args:
        path: The file to write.
        datums: Feature dicts, ``name -> (value, "byte" | "float" | "int")``.

    Returns:
        Each record's bytes (the serialized ``Example``), as a raw reader returns them.
    """
    from tfrecord.writer import TFRecordWriter

    writer = TFRecordWriter(os.fspath(path))
    records = []
    try:
        for datum in datums:
            records.append(TFRecordWriter.serialize_tf_example(dict(datum)))
            writer.write(dict(datum))
    finally:
        writer.close()
    return records


def read_tfrecords(path: StrPath, *, compression_type: str | None = None) -> list[bytes]:
    """Each record's raw bytes as ``tfrecord.reader.tfrecord_iterator`` reads them (it checks no CRC).

    Args:
        path: The TFRecord file.
        compression_type: ``None`` or ``"gzip"``.

    Returns:
        The records, copied (the iterator yields views into one buffer it reuses).

    Raises:
        RuntimeError: The tfrecord reader's ``Failed to read the record size.`` (or ``start token``,
            ``record``, ``end token``): the file ends inside a record.
    """
    from tfrecord.reader import tfrecord_iterator

    return [bytes(view) for view in tfrecord_iterator(os.fspath(path), compression_type=compression_type)]


def write_tfrecord_index(path: StrPath, index_path: StrPath) -> list[tuple[int, int]]:
    """Write the ``tfrecord`` package's index of a TFRecord file (``tfrecord2idx.create_index``).

    Args:
        path: The TFRecord file.
        index_path: The index file to write: one text line ``"<offset> <length>"`` per record,
            the length counting the 16 framing bytes.

    Returns:
        The ``(offset, length)`` pairs read back from the index file.
    """
    from tfrecord.tools.tfrecord2idx import create_index

    create_index(os.fspath(path), os.fspath(index_path))
    with open(index_path, encoding="ascii") as lines:
        return [(int(offset), int(length)) for offset, length in (line.split() for line in lines)]


def tfrecord_crc_errors(path: StrPath) -> list[int]:
    """The records of a TFRecord file whose length CRC or data CRC is wrong (tfrecord's reader checks neither).

    The CRCs are recomputed with ``tfrecord.TFRecordWriter.masked_crc``; the file must hold whole
    records (see :func:`read_tfrecords` for a cut one).

    Args:
        path: The TFRecord file.

    Returns:
        The indices of the records with a bad CRC.
    """
    from tfrecord.writer import TFRecordWriter

    with open(path, "rb") as f:
        data = f.read()
    bad, offset, index = [], 0, 0
    while offset < len(data):
        length_bytes = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        record = data[offset + 12 : offset + 12 + length]
        if data[offset + 8 : offset + 12] != TFRecordWriter.masked_crc(length_bytes) or data[
            offset + 12 + length : offset + 16 + length
        ] != TFRecordWriter.masked_crc(record):
            bad.append(index)
        offset, index = offset + TFRECORD_OVERHEAD + length, index + 1
    return bad


def write_tfrecords_cut_short(path: StrPath, records: Sequence[bytes], nbytes_from_end: int | None = None) -> None:
    """Write a TFRecord file whose last record is cut short.

    Args:
        path: The file to write.
        records: The records (at least one); the last one is the one cut.
        nbytes_from_end: How many bytes to cut off (1 to the last frame's size less one); ``None`` cuts
            the last record's data in the middle (its length CRC if it has no data).

    Raises:
        ValueError: No records, or a cut that does not end inside the last record.
    """
    if not records:
        raise ValueError("no record to cut")
    frame = TFRECORD_OVERHEAD + len(records[-1])
    if nbytes_from_end is None:
        nbytes_from_end = 4 + (len(records[-1]) + 1) // 2 if records[-1] else 6
    if not 0 < nbytes_from_end < frame:
        raise ValueError(f"cutting {nbytes_from_end} bytes does not end inside the last record ({frame} bytes)")
    write_tfrecords(path, records)
    truncate(path, nbytes_from_end)


# --- JSON lines ---------------------------------------------------------------------------------

_STRINGS = (
    "",
    "plain",
    "line one\nline two",
    "crlf\r\nand tab\t",
    'quotes " and backslash \\ and slash /',
    "unicode: café, Ελληνικά, 日本語",
    "outside the BMP: 🦀🎉",
    "separators U+2028 \u2028 U+2029 \u2029 NEL \x85 (str.splitlines splits on them)",
    "control \x00\x01\x1f",
    "   spaces around   ",
)


def make_json_objects(n: int, seed: int = 0) -> list[Any]:
    """Varied JSON objects for JSON lines: dicts with ``"id"`` (int) and ``"text"`` (str) always.

    Strings hold escaped newlines, quotes, backslashes, non-ASCII, non-BMP characters, U+2028/U+2029
    and NEL (which ``json.dumps(..., ensure_ascii=False)`` leaves raw), control characters; values
    include nested lists and dicts, big ints (``2**63``), floats (``1e300``, ``-0.0``, ``0.1``), bools
    and ``None``; ``"label"`` is missing from every 4th object.

    Args:
        n: How many objects.
        seed: Seed of the contents.

    Returns:
        The objects (each equal to ``json.loads(json.dumps(obj))``).
    """
    rng = random.Random(seed)
    objects: list[Any] = []
    for i in range(n):
        obj: dict[str, Any] = {"id": i, "text": _STRINGS[i % len(_STRINGS)] + (" " + str(i) if i % 2 else "")}
        if i % 4 != 3:
            obj["label"] = rng.choice((0, 1, -1, 2**63, -(2**63), 2**70, 0.1, -0.0, 1e300, 1.5e-300, True, False, None))
        if i % 3 == 0:
            obj["nested"] = {
                "list": [rng.randrange(100) for _ in range(rng.randrange(5))],
                "deeper": {"x": [{"y": _STRINGS[(i + 5) % len(_STRINGS)]}, [], {}], "empty": ""},
            }
        if i % 5 == 1:
            obj["ключ ✓"] = [None, True, 3.25, "é"]
        objects.append(obj)
    return objects


def write_jsonl(
    path: StrPath, objects: Iterable[Any], *, ensure_ascii: bool = True, final_newline: bool = True
) -> None:
    """Write one ``json.dumps(obj)`` per line, UTF-8, lines ended by ``"\\n"``.

    Args:
        path: The file to write.
        objects: JSON values.
        ensure_ascii: ``json.dumps``'s: ``True`` escapes every non-ASCII character (``\\uXXXX``,
            surrogate pairs outside the BMP); ``False`` writes them as UTF-8 (U+2028, U+2029 and NEL
            raw inside strings too).
        final_newline: End the last line with ``"\\n"`` (``False``: the file ends right after the
            last object).
    """
    lines = [json.dumps(obj, ensure_ascii=ensure_ascii) for obj in objects]
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))


def read_jsonl(path: StrPath, *, skip_blank: bool = False) -> list[Any]:
    """The objects of a JSON lines file: a plain loop over its ``b"\\n"``-ended lines and ``json.loads``.

    The file is read in binary, so only ``"\\n"`` ends a line (not U+2028, NEL or a lone ``"\\r"``);
    ``json.loads`` ignores the ``"\\r"`` of a CRLF line as whitespace.

    Args:
        path: The file.
        skip_blank: Skip lines holding only whitespace (else they raise, as ``json.loads("")`` does).

    Returns:
        The objects, in file order.

    Raises:
        json.JSONDecodeError: A line that is not one JSON value.
    """
    objects = []
    with open(path, "rb") as f:
        for line in f:
            if skip_blank and not line.strip():
                continue
            objects.append(json.loads(line))
    return objects


# --- bad files ----------------------------------------------------------------------------------


def truncate(path: StrPath, nbytes_from_end: int) -> None:
    """Cut the last ``nbytes_from_end`` bytes off a file.

    Args:
        path: The file.
        nbytes_from_end: How many bytes to cut, at most the file's size.

    Raises:
        ValueError: More bytes than the file holds, or a negative count.
    """
    size = os.path.getsize(path)
    if not 0 <= nbytes_from_end <= size:
        raise ValueError(f"cannot cut {nbytes_from_end} bytes off a file of {size}")
    os.truncate(path, size - nbytes_from_end)


def flip_byte(path: StrPath, offset: int) -> int:
    """Invert every bit of one byte of a file, in place.

    Args:
        path: The file.
        offset: The byte's offset; negative counts from the end, as in Python indexing.

    Returns:
        The byte's offset from the start of the file.

    Raises:
        IndexError: An offset outside the file.
    """
    size = os.path.getsize(path)
    position = offset + size if offset < 0 else offset
    if not 0 <= position < size:
        raise IndexError(f"offset {offset} outside a file of {size} bytes")
    with open(path, "r+b") as f:
        f.seek(position)
        (byte,) = f.read(1)
        f.seek(position)
        f.write(bytes([byte ^ 0xFF]))
    return position


def gzip_copy(src: StrPath, dst: StrPath) -> None:
    """Write a gzip-compressed copy of a file (gzip header mtime 0, so the same bytes each time).

    Args:
        src: The file to compress.
        dst: The compressed copy to write.
    """
    with open(src, "rb") as fin, open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fout:
        shutil.copyfileobj(fin, fout)
