"""The write-ahead log of a durable parameter server (``gradhub serve --durable``).

Every init and push a durable server applies is appended here as the message
it came in (header, key, meta, payload; unsigned); :meth:`WriteAheadLog.commit`
writes and ``fsync``s everything appended since the last commit *once*, and the
server sends the acknowledgements of those requests only after it. A server
commits once per batch of messages it drained from its socket, so when several
workers push at once their pushes share one ``fsync`` (group commit).

A checkpoint holds everything logged before it, so :meth:`reset` empties the
log after each checkpoint. At start the server loads its checkpoint and
replays the log through its ordinary exactly-once path: a record that the
checkpoint already holds (a crash between the checkpoint and the reset) is
recognised by its sequence number and skipped.

Record format: ``u32 body length, u32 crc32 of the body``, then the body:
per frame ``u32 length`` and its bytes. A torn record at the end (a crash
during a write) fails its length or checksum; reading stops there and the
file is cut back to the last whole record.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<II")
_FRAME = struct.Struct("<I")


class WriteAheadLog:
    """An append-only file of messages with group commit."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._pending: list[Any] = []
        self.size = os.fstat(self._fd).st_size
        self.commits = 0

    def records(self) -> Iterator[list[bytes]]:
        """Every whole record, oldest first (a torn tail is cut off)."""
        with open(self.path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _RECORD.size <= len(data):
            length, crc = _RECORD.unpack_from(data, pos)
            body = data[pos + _RECORD.size : pos + _RECORD.size + length]
            if len(body) != length or zlib.crc32(body) != crc:
                break
            frames, at = [], 0
            while at < length:
                (n,) = _FRAME.unpack_from(body, at)
                frames.append(body[at + _FRAME.size : at + _FRAME.size + n])
                at += _FRAME.size + n
            yield frames
            pos += _RECORD.size + length
        if pos < len(data):
            log.warning("write-ahead log %s: torn record at byte %d cut off", self.path, pos)
            os.truncate(self.path, pos)
            self.size = pos

    def append(self, frames: Sequence[Any]) -> None:
        """Queue one record; written by the next :meth:`commit`."""
        views = [memoryview(f).cast("B") for f in frames]
        crc = 0
        parts: list[Any] = []
        for v in views:
            head = _FRAME.pack(v.nbytes)
            crc = zlib.crc32(v, zlib.crc32(head, crc))
            parts += [head, v] if v.nbytes else [head]
        length = sum(memoryview(p).nbytes for p in parts)
        self._pending += [_RECORD.pack(length, crc), *parts]

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def commit(self) -> None:
        """Write every queued record and ``fsync`` once."""
        if not self._pending:
            return
        parts, self._pending = self._pending, []
        while parts:
            written = os.writev(self._fd, parts[:512])
            if written <= 0:
                raise OSError(f"write-ahead log {self.path}: nothing written")
            self.size += written
            parts = _advance(parts, written)
        os.fsync(self._fd)
        self.commits += 1

    def reset(self) -> None:
        """Empty the log (everything in it is in a checkpoint now)."""
        self._pending.clear()
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self.size = 0

    def close(self) -> None:
        os.close(self._fd)


def _advance(parts: list[Any], written: int) -> list[Any]:
    """``parts`` without their first ``written`` bytes (a short ``writev``)."""
    out = list(parts)
    while out:
        n = memoryview(out[0]).nbytes
        if written >= n:
            written -= n
            out.pop(0)
        elif written:
            out[0] = memoryview(out[0]).cast("B")[written:]
            written = 0
        else:
            break
    return out
