"""The address a peer on another node must dial to reach this process's node.

Why this module exists: two easy answers are wrong on a real cluster and right on one machine, so
tests on one machine never catch them. ``socket.gethostbyname(socket.gethostname())`` is
127.0.1.1 on Debian-style hosts (the hostname is mapped to loopback in /etc/hosts), and 127.0.0.1
reaches only the dialler's own node. The answers here:

- inside Ray (a worker, an actor, or a driver connected to a cluster): the node's IP as Ray reports
  it (``ray.util.get_node_ip_address()``), the address every other Ray node already reaches this
  one at (``ray start --node-ip-address`` when a site sets it);
- outside Ray: the local address of the interface the kernel routes towards the peer. Connecting a
  UDP socket sends no packet; it only makes the kernel pick the route and the source address.

``gloo_interface(peer)`` names that interface, for ``GLOO_SOCKET_IFNAME``: gloo otherwise binds
to whatever the hostname resolves to, which is loopback on the same hosts, and then advertises
127.0.0.1 to its peers on other nodes.

Only the standard library is imported here (Ray only when a Ray session already exists).
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from typing import Optional

# Addresses used only to ask the routing table which source address leaves this host (no packet
# is sent): private ranges first (cluster fabrics), then a public one (hosts with a default route).
ROUTE_PROBES = ("10.255.255.255", "172.31.255.255", "192.168.255.255", "8.8.8.8")
OVERRIDE_ENV = "MEGARL_NODE_IP"
_SIOCGIFADDR = 0x8915


class NoRoute(RuntimeError):
    """No route from this host towards the peer (or towards any probe address)."""


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to loopback (``localhost``)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(address, None)
        except socket.gaierror:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def route_address(peer: str) -> str:
    """This host's source address towards ``peer`` (an IP literal or a host name)."""
    try:
        infos = socket.getaddrinfo(peer, 9, proto=socket.IPPROTO_UDP)
    except socket.gaierror as err:
        raise NoRoute(f"cannot resolve peer host {peer!r}: {err}") from err
    last: Optional[OSError] = None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError as err:
                last = err
    raise NoRoute(f"no route from this host to {peer!r}: {last}")


def _ray_node_address() -> Optional[str]:
    """Ray's address of this node when this process belongs to a Ray session, else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    import ray.util

    return ray.util.get_node_ip_address()


def node_address(peer: Optional[str] = None) -> str:
    """The address processes on other nodes dial to reach this node (servers, rendezvous masters).

    ``MEGARL_NODE_IP`` overrides everything (sites with unusual routing). Inside Ray: Ray's
    address of this node. Outside Ray: the source address towards ``peer`` when given, else
    towards the first probe address that has a route. Never a loopback address unless ``peer``
    itself is loopback (then the peer is on this host and loopback is right).
    """
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        return override
    in_ray = _ray_node_address()
    if in_ray:
        return in_ray
    if peer is not None:
        address = route_address(peer)
        if is_loopback(address) and not is_loopback(peer):
            raise NoRoute(f"the route to {peer!r} leaves through loopback ({address}); set {OVERRIDE_ENV}")
        return address
    for probe in ROUTE_PROBES:
        try:
            address = route_address(probe)
        except NoRoute:
            continue
        if not is_loopback(address):
            return address
    raise NoRoute(f"cannot tell this node's address: no route to any of {', '.join(ROUTE_PROBES)}; "
                  f"pass the peer host or set {OVERRIDE_ENV}")


def interface_of(address: str) -> Optional[str]:
    """Name of the local interface holding IPv4 ``address`` (Linux), or None."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if answer[20:24] == packed:
                return name
    return None


def gloo_interface(peer: str) -> Optional[str]:
    """The interface gloo should bind to so that ``peer`` (the rendezvous master) can reach it back;
    None when the peer is on this host through loopback (gloo's default is then fine)."""
    if is_loopback(peer):
        return None
    return interface_of(route_address(peer))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface, for peers on other nodes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
