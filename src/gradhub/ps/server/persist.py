"""What a parameter server keeps on disk: its checkpoint file and, when durable,
its write-ahead log (:mod:`gradhub.ps.server.wal`).

At start (:meth:`Persistence.start`) the temporary files of checkpoint writes
that were killed half-way are removed, the checkpoint is loaded and the log's
messages are handed back for replay. :meth:`Persistence.save` writes a
checkpoint atomically and then empties the log, which the checkpoint now holds.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from gradhub.errors import InvalidOptionError
from gradhub.ps.server import checkpoint
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.wal import WriteAheadLog
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import Message, Status

log = logging.getLogger(__name__)

WAL_CHECKPOINT_BYTES = 1 << 30
"""A durable server checkpoints (and empties its log) once the log is this large."""


class Persistence:
    """The checkpoint file and write-ahead log of one server (either may be absent)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.path = config.checkpoint_path
        self.wal: WriteAheadLog | None = None

    @property
    def enabled(self) -> bool:
        """Whether anything is kept across restarts (a checkpoint directory is set)."""
        return self.path is not None

    @property
    def durable(self) -> bool:
        """Whether every applied init and push is logged and synced before its acknowledgement."""
        return self.wal is not None

    def start(self) -> tuple[dict[str, Any] | None, list[Message]]:
        """Clean up, then the checkpoint's state (or ``None``) and the logged messages."""
        if self.path is None:
            return None, []
        for tmp in checkpoint.remove_temporary(self.path):
            log.warning("removed %s, left by a checkpoint write that did not finish", tmp)
        state = checkpoint.load(self.path)
        if state is not None and state.get("mode") != self.config.mode:
            raise InvalidOptionError(
                f"checkpoint {self.path} was written in mode {state.get('mode')!r}, "
                f"this server runs {self.config.mode!r}; use another --checkpoint-dir"
            )
        messages: list[Message] = []
        if self.config.durable:
            self.wal = WriteAheadLog(self.path.with_suffix(".wal"))
            messages = [
                protocol.decode(frames, max_payload=self.config.max_payload)
                for frames in self.wal.records()
            ]
        return state, messages

    def log(self, msg: Message, *, refused: bool = False) -> None:
        """Append an applied init or push to the log (durable servers only); a
        ``refused`` one is logged as its header alone, status ``BAD_REQUEST``."""
        if self.wal is None:
            return
        if refused:
            header = dataclasses.replace(msg.header, flags=0, status=Status.BAD_REQUEST)
            self.wal.append(protocol.encode(header, msg.key))
            return
        header = dataclasses.replace(msg.header, flags=0)  # stored unsigned
        self.wal.append(protocol.encode(header, msg.key, msg.tensor(), meta=msg.meta))

    def commit(self) -> bool:
        """Make everything logged so far durable (one sync); whether it synced."""
        if self.wal is None or not self.wal.pending:
            return False
        self.wal.commit()
        return True

    @property
    def log_full(self) -> bool:
        return self.wal is not None and self.wal.size >= WAL_CHECKPOINT_BYTES

    def save(self, state: dict[str, Any]) -> None:
        """Write a checkpoint atomically, then empty the log it now holds."""
        assert self.path is not None
        checkpoint.save(state, self.path)
        if self.wal is not None:
            self.wal.reset()

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()
            self.wal = None
