"""Shared-memory primitives, below both :mod:`gradhub.transports` and :mod:`gradhub.ps`.

- :mod:`.memory`: anonymous ``memfd`` segments, their mappings, the set-up
  socket's exact reads; :mod:`.futex`: waits and wakes on a shared counter.
- :mod:`.hosts`: which processes share a host (host identity, the layout of a
  group's ranks by host) and the store exchanges that find out.

Linux only; nothing here knows about collectives or parameter servers.
"""
