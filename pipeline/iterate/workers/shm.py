"""Anonymous shared memory and the messages that carry it between processes.

Buffers are ``memfd`` files (an unlinked temporary file where ``memfd_create``
is missing): they have no name, so nothing can ever be left behind in
``/dev/shm`` or on disk, whatever happens to the processes; the kernel frees a
buffer when the last process that maps it or holds its descriptor is gone.
Buffers travel between processes as file descriptors over a Unix socket
(``SCM_RIGHTS``).

Objects travel as pickles (protocol 5) whose large array buffers are stored
out of band in a shared buffer, so an array is copied once into shared memory
by the sender and, at most, once out of it by the receiver.
"""

from __future__ import annotations

import array
import mmap
import os
import pickle
import socket
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Buffer", "dumps", "loads", "lease", "send", "recv", "ALIGN"]

ALIGN = 64  # byte alignment of each array buffer inside a shared buffer
_HEADER = struct.Struct("<Q")
_MAX_FDS = 64


def _anonymous_fd(size: int) -> int:
    """A new file descriptor of ``size`` zero bytes that has no name anywhere."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("quern", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux: an unlinked temporary file
        fd, path = tempfile.mkstemp(prefix="quern-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Buffer:
    """A shared buffer of ``size`` bytes mapped into this process.

    ``Buffer.create(size)`` makes a new one and keeps its descriptor (``fd``) to
    send to other processes; ``drop_fd()`` closes it once sent. ``Buffer(fd, size)``
    maps one received from another process and closes ``fd`` at once (the mapping
    holds the memory; one descriptor per buffer is all a process keeps).
    ``close()`` unmaps it (or leaves that to the arrays still viewing it); the
    memory is freed once no process maps it.

    Args:
        fd: The buffer's file descriptor (closed here if mapping it fails).
        size: Its size in bytes.
        private: Map it copy-on-write: this process may write to it, and nobody else sees the writes.
        keep_fd: Keep ``fd`` open (as ``self.fd``) after mapping it.

    Raises:
        OSError: The descriptor cannot be mapped.
    """

    def __init__(self, fd: int, size: int, *, private: bool = False, keep_fd: bool = False) -> None:
        self.size = size
        try:
            flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
            self.mm = mmap.mmap(fd, max(size, 1), flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        if not keep_fd:
            self.drop_fd()
        self.array: np.ndarray | None = np.frombuffer(self.mm, np.uint8, size)

    @classmethod
    def create(cls, size: int) -> Buffer:
        """A new anonymous buffer of at least ``size`` bytes (whole pages), keeping its descriptor.

        Args:
            size: The bytes it must hold.

        Returns:
            The buffer, zero-filled, with ``fd`` open to send to other processes.
        """
        size = -(-max(size, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        return cls(_anonymous_fd(size), size, keep_fd=True)

    def drop_fd(self) -> None:
        """Close the descriptor (the mapping stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A view of ``nbytes`` bytes of the buffer from ``offset`` (no copy).

        Args:
            offset: The first byte.
            nbytes: The number of bytes.

        Returns:
            A writable ``memoryview`` into the mapping.
        """
        return memoryview(self.mm)[offset : offset + nbytes]

    def close(self) -> None:
        """Close the descriptor and unmap the buffer, or leave the unmapping to the arrays still viewing it."""
        self.drop_fd()
        self.array = None
        try:
            self.mm.close()
        except BufferError:  # arrays still view it (a lent batch): the mapping goes when they do
            pass


def dumps(obj: Any, *, pickler: Callable = pickle.dumps, min_bytes: int = 0) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj`` with protocol 5, its large array buffers out of band.

    Args:
        obj: What to pickle.
        pickler: The function that pickles (``pickle.dumps``, ``cloudpickle.dumps``, ...),
            called with ``protocol`` and ``buffer_callback``.
        min_bytes: Contiguous buffers of at least this many bytes go out of band;
            smaller ones are copied into the pickle.

    Returns:
        ``(pickle, buffers)``: the pickle, and the out-of-band buffers in the order
        :func:`loads` wants them.
    """
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        if pb.raw().nbytes < min_bytes:
            return True  # small: keep in the pickle
        buffers.append(pb)
        return False

    return pickler(obj, protocol=5, buffer_callback=out_of_band), buffers


def layout(buffers: list[pickle.PickleBuffer]) -> tuple[list[tuple[int, int]], int]:
    """Where ``buffers`` go in a shared buffer: one after another, each aligned to :data:`ALIGN` bytes.

    Args:
        buffers: The out-of-band buffers of :func:`dumps`.

    Returns:
        ``([(offset, nbytes), ...], total bytes)``.
    """
    spans, end = [], 0
    for pb in buffers:
        n = pb.raw().nbytes
        spans.append((end, n))
        end += -(-n // ALIGN) * ALIGN
    return spans, end


def write(dst: Buffer, buffers: list[pickle.PickleBuffer], *, spans: list[tuple[int, int]]) -> None:
    """Copy each out-of-band buffer to its span of ``dst``.

    Args:
        dst: The shared buffer, at least as large as the spans reach.
        buffers: The out-of-band buffers of :func:`dumps`.
        spans: The ``(offset, nbytes)`` of each (:func:`layout`).
    """
    assert dst.array is not None, "the buffer is closed"
    for pb, (off, n) in zip(buffers, spans):
        dst.array[off : off + n] = np.frombuffer(pb.raw(), np.uint8)


def loads(data: bytes | memoryview, src: Buffer, *, spans: list[tuple[int, int]], copy: bool = True) -> Any:
    """Rebuild an object pickled by :func:`dumps` whose buffers were written to ``src``.

    Args:
        data: The pickle.
        src: The shared buffer holding its out-of-band buffers.
        spans: Where each lies in ``src``.
        copy: Copy each buffer out (the result owns its memory and ``src`` can be
            reused at once); ``False``: views into ``src``, valid only while ``src``
            keeps its contents.

    Returns:
        The object.
    """
    bufs: list[np.ndarray] | list[memoryview]
    if copy:
        bufs = [np.frombuffer(src.mm, np.uint8, n, off).copy() for off, n in spans]
    else:
        bufs = [src.view(off, n) for off, n in spans]
    return pickle.loads(data, buffers=bufs)


def lease(data: bytes, src: Buffer, *, spans: list[tuple[int, int]]) -> tuple[Any, np.ndarray]:
    """Rebuild an object pickled by :func:`dumps` with its arrays as views into ``src`` (no copy).

    ``src`` must not be reused while ``owner`` is alive.

    Args:
        data: The pickle.
        src: The shared buffer holding its out-of-band buffers.
        spans: Where each lies in ``src``.

    Returns:
        ``(object, owner)``: ``owner`` is the one array all the views derive from,
        so it dies exactly when no array of the object is alive any more (watch it
        with ``weakref.ref``).
    """
    owner = np.frombuffer(src.mm, np.uint8, spans[-1][0] + spans[-1][1]) if spans else np.empty(0, np.uint8)
    return pickle.loads(data, buffers=[owner[off : off + n] for off, n in spans]), owner


# --------------------------------------------------------------------------- messages


def send(sock: socket.socket, obj: Any, *, fds: Sequence[int] = ()) -> None:
    """Send one pickled message, with file descriptors attached to it.

    Args:
        sock: A connected Unix stream socket.
        obj: The message (picklable with the standard ``pickle``).
        fds: File descriptors to send with it (``SCM_RIGHTS``); the sender keeps its own.

    Raises:
        OSError: The socket is closed or the peer is gone (``BrokenPipeError``, ...).
    """
    payload = pickle.dumps(obj, protocol=5)
    frame = _HEADER.pack(len(payload)) + payload
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([frame], anc)
    if sent < len(frame):
        sock.sendall(memoryview(frame)[sent:])


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """Receive one message sent by :func:`send`.

    Args:
        sock: A connected Unix stream socket.

    Returns:
        ``(object, file descriptors)``; the descriptors arrive close-on-exec and are
        the caller's to close.

    Raises:
        EOFError: The peer has closed its end (or died).
        OSError: After reading the whole message, when the kernel had to drop the
            descriptors attached to it because this process has too many files open.
    """
    head, truncated = b"", False
    fds: list[int] = []
    try:
        while len(head) < _HEADER.size:
            data, anc, flags, _addr = sock.recvmsg(
                _HEADER.size - len(head), socket.CMSG_SPACE(_MAX_FDS * 4), getattr(socket, "MSG_CMSG_CLOEXEC", 0)
            )
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                    fds.extend(got)
            truncated |= bool(flags & socket.MSG_CTRUNC)
            if not data:
                raise EOFError("peer closed the connection")
            head += data
        (n,) = _HEADER.unpack(head)
        payload = bytearray(n)
        view, received = memoryview(payload), 0
        while received < n:
            k = sock.recv_into(view[received:])
            if not k:
                raise EOFError("peer closed the connection in the middle of a message")
            received += k
        if truncated:
            raise OSError(
                "a shared-memory descriptor from a worker was dropped: this process reached its limit of "
                "open files (ulimit -n); raise it, or lower num_workers, prefetch or read_ahead"
            )
        return pickle.loads(payload), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
