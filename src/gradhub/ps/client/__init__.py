"""The parameter-server client: :class:`~gradhub.ps.client.remote.RemoteParameterServer`.

- ``remote.py``: the public client; ``config.py``: its settings (``ClientConfig``).
- Where keys live: ``placement.py`` (server and slices of a key),
  ``optim_slices.py`` (a sliced key's optimizer state), ``addresses.py`` (the
  address forms accepted), ``payloads.py`` (what a reply's payload becomes).
- The I/O: ``channel.py`` (the sockets and the threads that drive them) owns an
  ``exchange.py`` (what is sent to each server and what each answer does) and
  its ``deadlines.py`` (retries, cancels, timeouts); ``link.py`` (one server and
  its requests), ``pending.py`` (a request's future: waiting on it drives the
  channel).
- Servers on this host: ``arena.py`` (payloads through shared memory),
  ``link_arenas.py`` (the channel's arenas, one per link that has one),
  ``shared_tensors.py`` (the user's own tensors there).

It shares :mod:`gradhub.ps.wire` with the server and imports nothing of
:mod:`gradhub.ps.server`.
"""
