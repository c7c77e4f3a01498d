"""Audit mode: what block mode would have stopped, read from NFLOG (`policy.suggest` turns it into a policy).

Measured on this machine: NFLOG works inside a network namespace (a netlink socket created in the
namespace receives its packets), whereas LOG output of a non-initial namespace is dropped unless the
host sets net.netfilter.nf_log_all_netns, and then all slots share one kernel log. So the renderer's
audit rules log to NFLOG group `AUDIT_NFLOG_GROUP` before accepting, and each slot reads its own.
Hits on always-denied destinations (the host, the metadata service, loopback) arrive on the same
group tagged `DENIED_LOG_PREFIX`: they are recorded with reason "always-denied", which no policy can
change, so the suggested policy leaves them out. Hits on internal ranges (private, CGNAT, ULA, ...)
that no `cidr:` rule opts into are tagged `INTERNAL_LOG_PREFIX` and refused in audit mode too: they
are recorded with reason "internal-address" and only named in the suggestion, never allowed by it.
The prefixes come from our rules, not the guest.
The packets come from the guest, so every header is parsed with bounds and anything odd is skipped,
and each logging rule logs at most `policy.render.LOG_LIMIT` packets a second (a few such rules per
slot, see there): under a flood, counts are lower bounds.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field

from policy.render import BLOCKED_LOG_PREFIX, DENIED_LOG_PREFIX, INTERNAL_LOG_PREFIX
from policy.suggest import ALWAYS_DENIED, BLOCK_LISTED, INTERNAL_ADDRESS, POLICY, REFUSED_DEST, AuditRecord
from runner.net import addresses, netns
from runner.net.loop import NetLoop

MAX_RECORDS_PER_SLOT = 4096
REFUSED_ANSWER = INTERNAL_ADDRESS  # the resolver's refusals, by their older name
COPY_RANGE = 64  # enough for an IPv6 header plus the ports

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_ULOG = 4
_NFULNL_MSG_PACKET = 0
_NFULNL_MSG_CONFIG = 1
_NFULA_CFG_CMD = 1
_NFULA_CFG_MODE = 2
_NFULA_CFG_QTHRESH = 5
_NFULA_PAYLOAD = 9
_NFULA_PREFIX = 10
_CMD_BIND = 1
_CMD_PF_BIND = 3
_COPY_PACKET = 2
_NLM_F_REQUEST = 1
_NLM_F_ACK = 4
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED (0x8000) and NLA_F_NET_BYTEORDER (0x4000)
_PROTOCOLS = {6: "tcp", 17: "udp", 1: "icmp", 58: "icmpv6"}


def parse_packet(payload: bytes) -> tuple[str, int | None, str] | None:
    """(destination, port, protocol) of an IP packet, or None when it is not one we can read."""
    if not payload:
        return None
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20:
        header_len = (payload[0] & 0x0F) * 4
        proto = payload[9]
        dest = str(ipaddress.IPv4Address(payload[16:20]))
        transport = payload[header_len:] if header_len >= 20 else b""
    elif version == 6 and len(payload) >= 40:
        proto = payload[6]
        dest = str(ipaddress.IPv6Address(payload[24:40]))
        transport = payload[40:]
    else:
        return None
    name = _PROTOCOLS.get(proto, str(proto))
    port = struct.unpack("!H", transport[2:4])[0] if name in ("tcp", "udp") and len(transport) >= 4 else None
    return dest, port, name


def _attributes(data: bytes) -> dict[int, bytes]:
    found: dict[int, bytes] = {}
    offset = 0
    while offset + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, offset)
        if length < 4 or offset + length > len(data):
            break
        found[kind & _NLA_TYPE_MASK] = data[offset + 4 : offset + length]
        offset += (length + 3) & ~3
    return found


def payloads(datagram: bytes) -> list[tuple[bytes, str]]:
    """(packet, reason) of each NFLOG message in one netlink datagram."""
    found: list[tuple[bytes, str]] = []
    offset = 0
    while offset + 16 <= len(datagram):
        length, kind = struct.unpack_from("=IH", datagram, offset)
        if length < 16 or offset + length > len(datagram):
            break
        if kind == (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_PACKET:
            attributes = _attributes(datagram[offset + 20 : offset + length])
            payload = attributes.get(_NFULA_PAYLOAD)
            if payload:
                found.append((payload, _reason(attributes.get(_NFULA_PREFIX, b""))))
        offset += (length + 3) & ~3
    return found


_REASONS = {DENIED_LOG_PREFIX.encode(): ALWAYS_DENIED, INTERNAL_LOG_PREFIX.encode(): INTERNAL_ADDRESS,
            BLOCKED_LOG_PREFIX.encode(): BLOCK_LISTED}


def _reason(prefix: bytes) -> str:
    return _REASONS.get(prefix.rstrip(b"\0"), POLICY)


def _config_message(group: int, attr_type: int, value: bytes, family: int = socket.AF_UNSPEC) -> bytes:
    attr = struct.pack("=HH", 4 + len(value), attr_type) + value
    attr += b"\0" * (-len(attr) % 4)
    body = struct.pack("=BBH", family, 0, socket.htons(group)) + attr
    header = struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_ULOG << 8) | _NFULNL_MSG_CONFIG, _NLM_F_REQUEST | _NLM_F_ACK, 0, 0)
    return header + body


def _expect_ack(sock: socket.socket, ns: str) -> None:
    reply = sock.recv(4096)
    if len(reply) >= 20 and struct.unpack_from("=H", reply, 4)[0] == 2:  # NLMSG_ERROR
        (code,) = struct.unpack_from("=i", reply, 16)
        if code != 0:
            raise OSError(-code, f"NFLOG configuration refused in namespace {ns}")


def open_nflog(ns: str, group: int = addresses.AUDIT_NFLOG_GROUP) -> socket.socket:
    """A netlink socket in namespace `ns` that receives the first bytes of every packet logged to `group`."""
    sock = netns.socket_in(ns, socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        sock.settimeout(2.0)
        for family in (socket.AF_INET, socket.AF_INET6):
            sock.send(_config_message(0, _NFULA_CFG_CMD, bytes([_CMD_PF_BIND]), family))
            _expect_ack(sock, ns)
        sock.send(_config_message(group, _NFULA_CFG_CMD, bytes([_CMD_BIND])))
        _expect_ack(sock, ns)
        sock.send(_config_message(group, _NFULA_CFG_MODE, struct.pack("!IBB", COPY_RANGE, _COPY_PACKET, 0)))
        _expect_ack(sock, ns)
        # One packet per message: the kernel otherwise batches for up to a second, and records
        # read when the job ends would miss its last attempts.
        sock.send(_config_message(group, _NFULA_CFG_QTHRESH, struct.pack("!I", 1)))
        _expect_ack(sock, ns)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class SlotAudit:
    """Counts of would-be-blocked (dest, port, proto) for one slot, fed by its NFLOG socket."""

    netns: str
    counts: Counter[tuple[str, int | None, str, str]] = field(default_factory=Counter)
    # Held from a datagram's recv until it is counted, by the loop thread and by readers alike: a
    # reader that drained while the loop thread held a datagram it had read but not counted yet
    # would miss it, and `clear` could run between the two and let the old job's packet be counted
    # for the next one (the slot is reused). Re-entrant: a reader drains under it.
    lock: threading.RLock = field(default_factory=threading.RLock)
    sock: socket.socket | None = None

    def start(self, loop: NetLoop) -> None:
        self.sock = open_nflog(self.netns)
        loop.add_reader(self.sock, self._on_readable)

    def stop(self, loop: NetLoop) -> None:
        if self.sock is not None:
            loop.remove_reader(self.sock)
            self.sock = None

    def clear(self) -> None:
        """Forget the job's records, including those still queued in the socket (the slot's rules
        no longer log by now, so nothing of the old job arrives afterwards)."""
        with self.lock:
            self._drain()
            self.counts.clear()

    def records(self, names: dict[str, str]) -> list[AuditRecord]:
        """Everything logged so far, including what the loop thread has not read yet."""
        with self.lock:
            self._drain()
            items = sorted(self.counts.items(), key=lambda item: (item[0][0], item[0][1] or 0, item[0][2], item[0][3]))
        return [AuditRecord(dest, port, proto, names.get(dest), count, reason)
                for (dest, port, proto, reason), count in items]

    def _drain(self) -> None:
        """Read every pending datagram (the caller holds the lock, so the loop thread reads none meanwhile)."""
        if self.sock is not None:
            while self._on_readable(self.sock):
                pass

    def _on_readable(self, sock: socket.socket) -> bool:
        """Count one datagram's packets; False when there was none to read."""
        with self.lock:
            try:
                datagram = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError as exc:  # ENOBUFS after an overrun: records stay a lower bound, keep reading
                return exc.errno == errno.ENOBUFS
            for payload, reason in payloads(datagram):
                parsed = parse_packet(payload)
                if parsed is None:
                    continue
                key = (*parsed, reason)
                if key in self.counts or len(self.counts) < MAX_RECORDS_PER_SLOT:
                    self.counts[key] += 1
        return True


def refused_answer_record(name: str, count: int) -> AuditRecord:
    """The record of `name`'s answers the resolver refused `count` times for pointing at internal
    addresses: without them (`REFUSED_DEST`), since the guest must not learn them from its record."""
    return AuditRecord(dest=REFUSED_DEST, port=None, proto="dns", name=name, count=count, reason=INTERNAL_ADDRESS)
