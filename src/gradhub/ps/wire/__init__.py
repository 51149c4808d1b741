"""What a parameter server and its clients share: the wire between them.

- ``protocol/``: what a message is (``message.py``), its frames and signature
  (``framing.py``), the commonest small messages packed and read in one step
  (``small.py``).
- ``frames.py``: a message's frames through a ZeroMQ socket;
  ``zmq_errors.py``: ZeroMQ's errors as gradhub's.
- ``status.py``: reply statuses to exceptions and back.
- ``optim_state.py``: a key's optimizer state in one message.
- ``arena.py``: the shared-memory arena of a client and a server on one host
  (its design, its switch, its Unix connection's messages).

Nothing here imports :mod:`gradhub.ps.client` or :mod:`gradhub.ps.server`.
"""
