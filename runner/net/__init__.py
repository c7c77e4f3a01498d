"""Per-VM networking: one network namespace per microVM, its egress rules, resolver and audit.

Public API (everything else is internal):

- `SlotPool(prefix, uplink, size, upstream=..., allowances=...)`: `start()` /
  `close()` (or `with`), `acquire(job="") -> Slot` (a new handle per lease), `release(slot)`
  (ignores a handle that is no longer out), `discard(slot)`, `sweep() -> list[str]`.
- `Slot`: `netns`, `tap` (the host opens it inside `netns` and hands QEMU the descriptor);
  `apply_policy(policy: policy.Policy) -> None` (raises; the VM must not start then);
  `audit_records() -> list[AuditRecord]` (`policy.AuditRecord`; `policy.suggest_policy` reads them).
- Uplinks: `HostUplink(out_iface)` (production, root namespace, NAT) and `NamespaceUplink(name)`.
- `Upstream(address, port=53, netns=None)`: where the guests' resolver asks allowed names.
- Guest-side constants in `runner.net.addresses` (baked into the snapshot template).

What the resolver promises (`runner.net.dns`): an allowed name's answer opens its addresses on the
rule's ports only, never an address in `policy.reserved.INTERNAL` (RFC 1918, CGNAT, link-local,
ULA, the uplink pool, and IPv6 forms carrying such an IPv4 address), in audit mode too, unless an
operator allowance or a `cidr:` rule lying inside that range (`policy.reserved.opted_in`) covers
it; openings last the answer's TTL clamped to 60 s..1 h and close within
a sweep (2 s) of that; answers opening new addresses rewrite the chain at most 64 times at once and
2 a second after (past that the guest gets SERVFAIL); a destroyed slot's resolver never writes again.
TEST-NET answers are not refused (see `policy.reserved` for why, and what that leaves open).

What the name check promises (`runner.net.nameproxy`, `runner.net.namecheck`): TCP under a
`host:` rule (not `raw: true`) is never forwarded by the kernel; the slot's nat table redirects it
to a checker in the namespace that admits it only when its TLS SNI or HTTP Host is a name the
policy allows on that port *and* the address dialled was handed out by this resolver for that
name (live opening); each later request of a kept-alive HTTP connection is checked too. Rules
with `methods:`/`paths:` are read request by request, HTTPS through TLS terminated with the job's
own CA (`runner.net.jobca`, key in memory only, dropped at slot reset). The operator's block list
(`policy.blocklist`) is refused by the resolver, the checker and the raw guard in every mode.
"""

from policy.suggest import AuditRecord
from runner.net.dns import Upstream
from runner.net.firewall import Firewall, FirewallError
from runner.net.slots import Slot, SlotError, SlotPool
from runner.net.uplink import HostUplink, NamespaceUplink, Uplink, UplinkError

__all__ = [
    "AuditRecord",
    "Firewall",
    "FirewallError",
    "HostUplink",
    "NamespaceUplink",
    "Slot",
    "SlotError",
    "SlotPool",
    "Uplink",
    "UplinkError",
    "Upstream",
]
