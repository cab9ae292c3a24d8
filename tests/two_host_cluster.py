"""A throwaway TWO-host SLURM cluster on one machine, for joint multi-node training.

Each host is a network namespace with an ``eth1`` of its own address, joined to the other by veth
pairs on a bridge in the machine's namespace; slurmctld runs there and listens on the bridge's
address, which both hosts reach. Each slurmd runs inside its namespace, started with
``nsenter --net=/run/netns/<name> slurmd -N <node>`` (``ip netns exec`` would remount /sys, and
slurmd then fails its cgroup check), so the jobs it runs, and the ranks they start, see only that
host's network. Both hosts share the machine's hostname, so anything that must tell them apart uses
addresses: NodeAddr is each host's eth1 address, and torchrun rendezvous statically on the first
node's address (c10d rendezvous hangs here). The ranks need ``GLOO_SOCKET_IFNAME=eth1``.

Only addresses of these two hosts, the bridge and loopback are used. Everything (namespaces, links,
daemons, the processes left in the namespaces) is removed by name or pid at the end.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from slurm_cluster import GPUS, PARTITION, SlurmCluster, available_memory_mb, unavailable_reason, which

NETWORK_TOOLS = ("ip", "nsenter")
IFACE = "eth1"  # the hosts' interface: GLOO_SOCKET_IFNAME for the ranks


def two_host_unavailable_reason() -> str | None:
    """Why the two-host cluster cannot be started here, or None."""
    missing = [name for name in NETWORK_TOOLS if which(name) is None]
    if missing:
        return f"not found: {', '.join(missing)} (apt-get install iproute2 util-linux, as .ci/run does)"
    return unavailable_reason()


def free_subnet(used: list[str], prefix: str = "10.213") -> ipaddress.IPv4Network:
    """A /24 under ``prefix`` that overlaps none of the ``used`` interface networks (``ip -o addr``)."""
    taken = [ipaddress.ip_interface(u).network for u in used]
    start = os.getpid() % 250  # parallel test sessions start apart
    for k in range(250):
        net = ipaddress.ip_network(f"{prefix}.{(start + k) % 250}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /24 under {prefix}.0.0/16")


def two_host_conf(
    base: str, host: str, ctld_addr: str, nodes: dict[str, str], root: Path, partition: str, cpus: int, memory_mb: int
) -> str:
    """slurm.conf of the single-machine cluster (``base``) with the controller on the bridge's address,
    ``nodes`` (name -> address) as the compute nodes, and per-node (``%n``) slurmd paths."""
    replace = {
        "SlurmctldHost": f"SlurmctldHost={host}({ctld_addr})",
        "SlurmdPidFile": f"SlurmdPidFile={root}/slurmd-%n.pid",
        "SlurmdLogFile": f"SlurmdLogFile={root}/slurmd-%n.log",
        "SlurmdSpoolDir": f"SlurmdSpoolDir={root}/spool/%n",
    }
    lines = []
    for line in base.splitlines():
        key = line.split("=", 1)[0]
        if key not in ("NodeName", "PartitionName"):
            lines.append(replace.get(key, line))
    missing = set(replace) - {line.split("=", 1)[0] for line in base.splitlines()}
    if missing:
        raise ValueError(f"slurm.conf template lacks {sorted(missing)}")
    lines += [
        f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory={memory_mb} Gres=gpu:{GPUS} State=UNKNOWN"
        for name, addr in nodes.items()
    ]
    lines.append(f"PartitionName={partition} Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([which("ip"), *args], capture_output=True, text=True, check=check, timeout=30)


def netns_pids(name: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", name, check=False).stdout.split()]


@dataclass
class TwoHostCluster(SlurmCluster):
    # scontrol too: launch.py, in the job, asks it for the job's nodes and the first node's address
    WRAPPED: ClassVar[tuple[str, ...]] = ("srun", "scontrol")

    hosts: int = 2
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    node_addrs: dict = field(default_factory=dict)  # node name -> eth1 address
    bridge_addr: str = ""
    _links: list = field(default_factory=list)  # links and namespaces made, for teardown
    _netns: list = field(default_factory=list)

    def netns_name(self, i: int) -> str:
        return f"slurmt{self.tag}-{i}"

    def host_pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s network namespace."""
        return netns_pids(self.netns_name(i))

    def _network(self) -> None:
        used = [line.split()[3] for line in ip("-o", "-4", "addr").stdout.splitlines()]
        net = free_subnet(used)
        hosts = list(net.hosts())
        bridge = f"sbr{self.tag}"
        self.bridge_addr = str(hosts[0])
        ip("link", "add", "name", bridge, "type", "bridge")
        self._links.append(bridge)
        ip("addr", "add", f"{self.bridge_addr}/{net.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i in range(self.hosts):
            ns, outer, inner = self.netns_name(i), f"sv{self.tag}h{i}", f"sv{self.tag}n{i}"
            ip("netns", "add", ns)
            self._netns.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._links.append(outer)
            ip("link", "set", outer, "master", bridge, "up")
            ip("link", "set", inner, "netns", ns)
            addr = str(hosts[10 + i])
            ip("-n", ns, "link", "set", inner, "name", IFACE)
            ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", IFACE)
            ip("-n", ns, "link", "set", IFACE, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            self.node_addrs[f"node{i}"] = addr

    def _prepare(self, host: str) -> None:
        """The hosts' network, then the single-machine cluster's files with slurm.conf made two-host."""
        self._network()
        super()._prepare(host)
        conf = two_host_conf(self.conf.read_text(), host, self.bridge_addr, self.node_addrs, self.root,
                             self.partition, self.cpus, self.memory_mb)  # fmt: skip
        self.conf.write_text(conf)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)

    def _slurmd_commands(self, host: str) -> dict[str, list[str]]:
        """One slurmd per host, each in its host's network namespace."""
        return {
            f"slurmd-{node}": ["nsenter", f"--net=/run/netns/{self.netns_name(i)}", which("slurmd"), "-D", "-f",
                               str(self.conf), "-N", node]
            for i, node in enumerate(self.nodes)
        }  # fmt: skip

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._teardown_network()

    def _teardown_network(self) -> None:
        # processes still inside the namespaces (a job's orphans) are ours: end them by pid first
        for ns in self._netns:
            for pid in netns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns in self._netns:
            ip("netns", "del", ns, check=False)
        for link in reversed(self._links):
            ip("link", "del", link, check=False)
        self._netns.clear()
        self._links.clear()


def start_two_host_cluster(root: Path, partition: str = PARTITION, timeout: float = 90) -> TwoHostCluster:
    """Start munged, slurmctld and one slurmd per host namespace; each host claims 2 CPUs."""
    memory_mb = max(2048, int(available_memory_mb() * 0.4))
    cluster = TwoHostCluster(root=root, partition=partition, cpus=2, memory_mb=memory_mb)
    cluster.start(timeout=timeout)
    return cluster
