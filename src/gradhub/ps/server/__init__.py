"""The parameter-server process: ``gradhub serve``, ``start_server``.

- ``config.py``: ``ServerConfig``; ``launch.py``: ``start_server`` (a process or
  a thread); ``server.py``: the process's loop and socket, which owns a
  ``service.py`` (what each request does).
- Semantics: ``store.py`` (values and optimizers), ``consistency.py``
  (async, sync, ssp), ``waits.py`` (requests held for a round or an init),
  ``dedupe.py`` (exactly once), ``rejects.py`` (messages it cannot accept).
- Durability: ``persist.py`` over ``checkpoint.py`` and ``wal.py``.
- Clients on this host: ``arenas.py`` (their shared-memory segments).

It shares :mod:`gradhub.ps.wire` with the client and imports nothing of
:mod:`gradhub.ps.client`.
"""
