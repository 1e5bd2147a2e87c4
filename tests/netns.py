"""Pods on one machine: Linux network namespaces joined by a bridge, each with its own address and /etc/hosts, for
tests/test_multihost.py and benchmarks/chaos.py (which also cuts and slows their links).

`Network(hosts)` makes a namespace `<prefix>-<host>` per host, a veth pair from each to a bridge in a further
namespace (the "switch", `<prefix>-sw`), an address 10.77.<net>.<n> per host, and /etc/netns/<ns>/hosts (`ip netns
exec` mounts it over /etc/hosts) so that every host answers to the names given, e.g. the Service names of
deploy/k8s. `close` removes all of it. Needs root; `namespaces_unavailable` says why not where it cannot run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

SUBNET = "10.77.{net}.{host}"


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"arl-probe-{os.getpid()}"
    made = ip("netns", "add", probe)
    if made.returncode != 0:
        return f"the kernel or container forbids network namespaces: {made.stderr.strip()}"
    ip("netns", "del", probe)
    return None


def _must(command: str, *args: str) -> None:
    done = subprocess.run([command, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{command} {' '.join(args)}: {done.stderr.strip()}")


class Network:
    """Namespaces `<prefix>-<host>` joined by veth pairs to a bridge in `<prefix>-sw`; removed by `close`.

    `hosts`: host name -> the names it answers to (its address is 10.77.<net>.<its position + 1>)."""

    def __init__(self, hosts: dict[str, list[str]]) -> None:
        self.hosts = dict(hosts)
        self.prefix = f"arl{uuid.uuid4().hex[:6]}"
        self.net = int(self.prefix[-2:], 16) % 200 + 20  # 10.77.<net>.0/24: distinct between concurrent runs
        self.switch = f"{self.prefix}-sw"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return SUBNET.format(net=self.net, host=list(self.hosts).index(host) + 1)

    def switch_port(self, host: str) -> str:
        """The switch's end of `host`'s veth pair (in the switch namespace)."""
        return f"{self.prefix}b{list(self.hosts).index(host)}"

    def open(self) -> Network:
        _must("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _must("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(host)} {' '.join(names)}\n" for host, names in self.hosts.items() if names)
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            _must("ip", "netns", "add", ns)
            self.made.append(ns)
            host_end, switch_end = f"{self.prefix}a{i}", self.switch_port(host)
            _must("ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _must("ip", "link", "set", host_end, "netns", ns, "name", "eth0")
            _must("ip", "link", "set", switch_end, "netns", self.switch)
            _must("ip", "-n", self.switch, "link", "set", switch_end, "master", "br0")
            _must("ip", "-n", self.switch, "link", "set", switch_end, "up")
            _must("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _must("ip", "-n", ns, "link", "set", "eth0", "up")
            _must("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        return self

    def cut(self, host: str, down: bool) -> None:
        """Partition `host` from every other (its switch port down: its eth0 loses carrier) or heal it."""
        _must("ip", "-n", self.switch, "link", "set", self.switch_port(host), "down" if down else "up")

    def slow(self, host: str, rate: str | None) -> None:
        """Shape both directions of `host`'s link with a token bucket (`tc ... tbf`) of `rate`, e.g. "64kbit", whose
        queue holds up to 2 s of traffic (later packets are dropped); None removes it. (`tc netem`'s loss and delay
        are what a lossy network would want; kernels without sch_netem, like this one's, refuse it.)"""
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.switch_port(host))):
            if rate is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            else:
                _must("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "4kb",
                      "latency", "2s")

    def close(self) -> None:
        for ns in self.made:
            ip("netns", "del", ns)  # takes its veth ends (and so the pairs) with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.made = []
