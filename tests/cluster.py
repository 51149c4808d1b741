"""An emulated multi-host cluster on one machine: network namespaces behind a bridge.

For tests and benchmarks only (root needed). ``Cluster(hosts=3, rate="1gbit")``
creates one network namespace per emulated host, each with an ``eth0`` (one
end of a veth pair; the other end joins a private bridge) holding an address
of a private test subnet, ``lo`` up, and a ``tbf`` rate limit on both ends of
every link, so every packet between two hosts passes two limiters of the
same rate (the link's rate in each direction). Segmentation offloads are
turned off on the veths so the limiters see wire-sized packets (read back: a
veth that keeps one fails the set-up with :class:`ClusterError`).

Traffic stays inside: the bridge has no address in the machine's own
namespace and the namespaces have no route but their subnet, so nothing can
reach an address outside the namespaces created here.

``cluster.popen(host, argv)`` starts a process inside a host (``ip netns
exec``) with ``GLOO_SOCKET_IFNAME=eth0`` (``Cluster(..., gloo_ifname=False)``:
without it, also when the caller's environment has one, so that what runs
inside has to work the interface out itself); ``close()`` (also on ``__exit__``,
also after a failure) kills every process still inside the namespaces (``ip
netns pids``: all of them were started here), deletes the namespaces (which
deletes their veths) and the bridge. Names carry a per-process tag, so
concurrent runs do not collide; they also carry the creating process's id, so
a new cluster first removes what a killed run (no ``close()``) left behind.

``Cluster.unavailable()`` says why the machine cannot build one (not root, no
``ip``/``tc``, namespaces refused), or ``None``; tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any

RATES = {"1gbit": 1_000_000_000, "10gbit": 10_000_000_000}
"""The link profiles (bits per second)."""

_counter = itertools.count()


class ClusterError(RuntimeError):
    """The emulated cluster could not be built."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one interface."""

    index: int
    netns: str
    addr: str
    ifname: str = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ClusterError(f"tc {' '.join(args)}: {done.stderr.strip()}")


_SIOCETHTOOL = 0x8946
_OFFLOADS = {  # name: (ETHTOOL_G*, ETHTOOL_S*) of <linux/ethtool.h>
    "tso": (0x1E, 0x1F),
    "gso": (0x23, 0x24),
    "gro": (0x2B, 0x2C),
}


def _ethtool(s: socket.socket, ifname: str, cmd: int, data: int = 0) -> int:
    """One ``struct ethtool_value`` ioctl on ``ifname``; the value it holds after."""
    value = ctypes.create_string_buffer(struct.pack("II", cmd, data), 8)
    request = struct.pack("16sP", ifname.encode(), ctypes.addressof(value))
    fcntl.ioctl(s, _SIOCETHTOOL, request)
    return int(struct.unpack("II", value.raw)[1])


def offloads(ifname: str) -> dict[str, bool]:
    """Whether TSO, GSO and GRO are on for ``ifname`` (in this process's namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return {name: bool(_ethtool(s, ifname, get)) for name, (get, _) in _OFFLOADS.items()}


def _offloads_off(ifname: str) -> None:
    """Turn TSO, GSO and GRO off on ``ifname`` (what ``ethtool -K`` does; no ethtool
    here), read them back, and raise :class:`ClusterError` if one stays on:
    a ``tbf`` limiter would then meter 64 KB segments instead of wire-sized
    packets, and every rate measured through it would be wrong."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name, (get, set_) in _OFFLOADS.items():
            try:
                _ethtool(s, ifname, set_, 0)
                on = _ethtool(s, ifname, get)
            except OSError as exc:
                raise ClusterError(f"cannot turn {name} off on {ifname}: {exc}") from None
            if on:
                raise ClusterError(f"{name} is still on on {ifname} after turning it off")


_STALE_NS = re.compile(r"gh(\d+)x\d+h\d+")
_STALE_BRIDGE = re.compile(r"ghb(\d+)x\d+")


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _sweep_stale() -> None:
    """Remove what a killed run (SIGKILL: no ``close()``) left: names carry its pid."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _STALE_NS.fullmatch(name)
        if m and _dead(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip() if len(parts) > 1 else ""
        m = _STALE_BRIDGE.fullmatch(name)
        if m and _dead(int(m.group(1))):
            _ip("link", "del", name, check=False)


class Cluster:
    """``hosts`` emulated hosts joined by ``rate``-limited links (``None``: no limit)."""

    def __init__(self, hosts: int, *, rate: str | None = "1gbit", gloo_ifname: bool = True) -> None:
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        _sweep_stale()
        tag = f"{os.getpid()}x{next(_counter)}"
        self.tag = tag
        self.bridge = f"ghb{tag}"
        # 10.213.0.0/16 is a private test subnet; each cluster has its own
        # bridge (its own L2 segment), so two clusters never see each other.
        self.hosts = [Host(i, f"gh{tag}h{i}", f"10.213.0.{i + 1}") for i in range(hosts)]
        self.rate: str | None = None
        self.gloo_ifname = gloo_ifname
        self._procs: list[subprocess.Popen[Any]] = []
        self._made_ns: list[str] = []
        self._made_bridge = False
        try:
            self._build()
            self.set_rate(rate)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        """Why an emulated cluster cannot be built here, or ``None`` if it can."""
        if os.geteuid() != 0:
            return "needs root (network namespaces, veth pairs, tc)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"needs the `{tool}` command (iproute2)"
        probe = f"ghprobe{os.getpid()}"
        done = _ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            return f"`ip netns add` failed: {done.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    # building ----------------------------------------------------------------------

    def _veth(self, host: Host) -> str:
        return f"ghv{self.tag}h{host.index}"

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            outer, inner = self._veth(host), f"ghp{self.tag}h{host.index}"
            _ip("netns", "add", host.netns)
            self._made_ns.append(host.netns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _offloads_off(outer)
            _offloads_off(inner)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("-n", host.netns, "link", "set", inner, "name", host.ifname)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def set_rate(self, rate: str | None) -> None:
        """Put a ``tbf`` limit of ``rate`` ("1gbit", "10gbit") on every link, or remove it."""
        if rate is not None and rate not in RATES:
            raise ValueError(f"rate must be one of {sorted(RATES)} or None, got {rate!r}")
        for host in self.hosts:
            for prefix, dev in ((["-n", host.netns], host.ifname), ([], self._veth(host))):
                subprocess.run(
                    ["tc", *prefix, "qdisc", "del", "dev", dev, "root"],
                    capture_output=True,
                    timeout=30,
                )
                if rate is None:
                    continue
                bps = RATES[rate]
                # Bucket of 2 ms at the line rate (at least 64 KB), queue of 20 ms.
                burst = max(65536, bps // 8 // 500)
                _tc(*prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(bps),
                    "burst", str(burst), "latency", "20ms")  # fmt: skip
        self.rate = rate

    # processes ---------------------------------------------------------------------

    def env(self, host: Host, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``host``: ours, plus (or, with
        ``gloo_ifname=False``, minus) GLOO_SOCKET_IFNAME; then ``extra``."""
        env = dict(os.environ)
        if self.gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        else:
            env.pop("GLOO_SOCKET_IFNAME", None)
        env.update(extra or {})
        return env

    def popen(
        self,
        host: int | Host,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        cwd: str | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; :meth:`close` ends it."""
        h = self.hosts[host] if isinstance(host, int) else host
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, *argv],
            env=self.env(h, env),
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            start_new_session=True,
            **kw,
        )
        self._procs.append(proc)
        return proc

    def run(
        self, host: int | Host, argv: Sequence[str], *, timeout: float = 60.0, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` to the end, output captured (text)."""
        h = self.hosts[host] if isinstance(host, int) else host
        return subprocess.run(
            ["ip", "netns", "exec", h.netns, *argv],
            env=self.env(h, kw.pop("env", None)),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def _pids_inside(self) -> list[int]:
        pids: list[int] = []
        for ns in self._made_ns:
            done = _ip("netns", "pids", ns, check=False)
            pids += [int(p) for p in done.stdout.split() if p.isdigit()]
        return pids

    # teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs inside, delete namespaces, veths and the bridge. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        # Processes that left the launchers' sessions (torchrun's workers) are
        # still inside the namespaces: every one of them was started here.
        for _ in range(50):
            pids = self._pids_inside()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self._procs.clear()
        for host in self.hosts:
            if host.netns in self._made_ns:
                _ip("link", "del", self._veth(host), check=False)  # deletes its peer too
        for ns in self._made_ns:
            _ip("netns", "del", ns, check=False)
        self._made_ns.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
