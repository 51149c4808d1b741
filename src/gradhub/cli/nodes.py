"""Where this node stands in a multi-node job, worked out from the rendezvous endpoint.

torchrun across machines needs three facts that its options leave to the
user, and that go wrong silently where the machine's host name does not
resolve to a reachable address (containers, network namespaces, hosts with
several interfaces):

- the address other nodes reach this node at (torchrun's ``--local-addr``):
  the source address the kernel picks to reach the rendezvous endpoint;
- whether this node hosts the rendezvous store (``--rdzv-conf is_host=1``):
  it does when that source address *is* the endpoint's address (or, when the
  endpoint is loopback and every node is on this machine, on node rank 0);
- the interface gloo should use (``GLOO_SOCKET_IFNAME``): the one holding
  that address.

:func:`locate` works them out without sending anything: connecting a UDP
socket only asks the kernel for a route.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from gradhub.errors import InvalidOptionError, LaunchEnvironmentError

DEFAULT_RDZV_PORT = 29400
"""torchrun's default port of the c10d rendezvous endpoint."""

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, kw_only=True)
class NodePlace:
    """What :func:`locate` worked out for this node."""

    endpoint_host: str
    """The rendezvous endpoint's host, as given."""
    endpoint_addr: str
    """The endpoint host's IP address."""
    endpoint_port: int
    """The rendezvous endpoint's port."""
    local_addr: str
    """The address this node reaches the endpoint from (other nodes reach it there)."""
    is_host: bool
    """Whether this node hosts the rendezvous store."""
    ifname: str | None
    """The interface holding :attr:`local_addr` (``None`` if not found)."""


def split_endpoint(endpoint: str, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"HOST"``, or ``"[v6]:PORT"``) as ``(host, port)``."""
    text = endpoint.strip()
    if not text:
        raise InvalidOptionError("the rendezvous endpoint is empty; give HOST:PORT")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise InvalidOptionError(f"rendezvous endpoint {endpoint!r} has no host; give HOST:PORT")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidOptionError(
            f"rendezvous endpoint {endpoint!r} has no valid port; give HOST:PORT"
        )
    return host, int(port_text)


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds the IPv4 address ``addr`` (Linux), or ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == addr:
                return name
    return None


def locate(endpoint: str, *, node_rank: int = 0) -> NodePlace:
    """Work out this node's address, whether it hosts the store, and its interface."""
    host, port = split_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise InvalidOptionError(
            f"cannot resolve the rendezvous endpoint's host {host!r}: {exc}\n"
            "- help: give its IP address in --rdzv-endpoint"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    endpoint_addr = str(sockaddr[0])
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((endpoint_addr, port))  # a route lookup: nothing is sent
        except OSError as exc:
            raise LaunchEnvironmentError(
                f"no route from this node to the rendezvous endpoint {host}:{port}: {exc}"
            ) from None
        local_addr = str(s.getsockname()[0])
    if ipaddress.ip_address(endpoint_addr).is_loopback:
        is_host = node_rank == 0  # every node on this machine: the first one hosts
    else:
        is_host = local_addr == endpoint_addr
    ifname = interface_of(local_addr) if family == socket.AF_INET else None
    return NodePlace(
        endpoint_host=host,
        endpoint_addr=endpoint_addr,
        endpoint_port=port,
        local_addr=local_addr,
        is_host=is_host,
        ifname=ifname,
    )
