"""Start parameter servers from Python: in a child process or in a thread.

``start_server(config)`` returns a :class:`ServerHandle` once the server is
bound, with its resolved :attr:`~ServerHandle.address`. A process server is a
fresh interpreter (``spawn``), like ``gradhub serve``; ``close()`` asks it to
checkpoint and exit (SIGTERM), ``kill()`` ends it at once (SIGKILL, no last
checkpoint: what a crash looks like). A thread server shares this process and
is meant for tests and single-machine tools.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from types import TracebackType
from typing import Any

from gradhub.errors import GradhubError, GradhubTimeoutError
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.server import Server, configure_process

log = logging.getLogger(__name__)


def _child(config: ServerConfig, conn: Any, log_level: int) -> None:
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [server]: %(message)s"
    )
    try:
        configure_process(config)
        server = Server(config)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    conn.send(("ok", server.address))
    conn.close()
    server.serve()


class ServerHandle:
    """A running parameter server: :attr:`address`, :meth:`close`, :meth:`kill`."""

    def __init__(
        self,
        address: str,
        *,
        process: Any = None,
        server: Server | None = None,
        thread: threading.Thread | None = None,
    ):
        self.address = address
        self._process = process
        self._server = server
        self._thread = thread

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def is_alive(self) -> bool:
        if self._process is not None:
            return bool(self._process.is_alive())
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Checkpoint and stop the server; idempotent."""
        if self._process is not None:
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout)
            if self._process.is_alive():
                log.warning("server %s did not stop in %gs; killing it", self.address, timeout)
                self._process.kill()
                self._process.join(5)
        elif self._server is not None and self._thread is not None:
            self._server.stop()
            self._thread.join(timeout)

    def kill(self) -> None:
        """End a process server at once, without a last checkpoint."""
        if self._process is None:
            raise GradhubError("kill() needs a process server; use close() for a thread server")
        self._process.kill()
        self._process.join(10)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_server(
    config: ServerConfig, *, in_thread: bool = False, start_timeout: float = 60.0
) -> ServerHandle:
    """Start a parameter server and return once it listens."""
    if in_thread:
        server = Server(config)
        thread = threading.Thread(target=server.serve, name="gradhub-ps-server", daemon=True)
        thread.start()
        return ServerHandle(server.address, server=server, thread=thread)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    level = logging.getLogger("gradhub").getEffectiveLevel()
    process = ctx.Process(target=_child, args=(config, child, level), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(start_timeout):
            raise GradhubTimeoutError(
                f"parameter server for {config.bind} did not start in {start_timeout:g}s"
            )
        status, detail = parent.recv()
    except EOFError:
        process.join(5)
        raise GradhubError(
            f"parameter server for {config.bind} exited before it was ready "
            f"(exit code {process.exitcode}); if start_server is called from a script, "
            "guard the call with `if __name__ == '__main__':`"
        ) from None
    except BaseException:
        process.kill()
        process.join(5)
        raise
    finally:
        parent.close()
    if status != "ok":
        process.join(5)
        raise GradhubError(f"parameter server for {config.bind} failed to start: {detail}")
    return ServerHandle(detail, process=process)
