"""What both sides of the arena's Unix connection share: its messages and the
registration's signature.

A message is one ``SOCK_SEQPACKET`` packet: a kind byte, then its body.
``R`` registers the client (JSON: session, worker, and with a shared secret the
MAC of :func:`registration_mac`); ``S`` hands a segment over (id and size, its
descriptor beside); ``F`` forgets one (id); ``B`` is the server's goodbye.
``C`` cancels a pull into a user's tensor (its request id): the server will not
write into that tensor for it, and confirms with ``c`` (the same id) from its
loop, so never while it is writing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

SEGMENT = struct.Struct("<IQ")  # id, size
ID = struct.Struct("<I")
RID = struct.Struct("<Q")  # a request id
CREDS = struct.Struct("3i")  # pid, uid, gid
REGISTER, NEW, FORGET, BYE, CANCEL, CANCELLED = b"R", b"S", b"F", b"B", b"C", b"c"


def registration_mac(secret: bytes, nonce: bytes, session: int, worker: int) -> str:
    data = b"gradhub-ps-arena" + nonce + struct.pack("<QI", session, worker)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()
