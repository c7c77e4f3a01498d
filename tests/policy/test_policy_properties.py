"""Property tests: the loader never fails with anything but PolicyError, rendering always ends in
the verdict, and intersection is never wider than either side."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy import OperatorAllowances, Policy, PolicyError, RenderContext, Rule, intersect, load_policy, render
from policy.load import RULE_KEYS, TOP_KEYS

LIMIT = "-m limit --limit 100/second --limit-burst 200"  # every NFLOG rule is rate-limited

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTEXT = RenderContext(guest_ip="172.16.0.2", guest_mac="52:54:00:00:00:02", gateway_ip="172.16.0.1",
                        dns_ip="172.16.0.1", guest_ip6="fd00::2", host_addresses=("192.0.2.1",))

# Small universes, so that random rules overlap often enough to make intersection interesting.
BASES = ["example.org", "a.example.org", "b.example.org", "a.b.example.org", "pypi.org", "x.pypi.org"]
PORTS = [22, 53, 80, 443, 8080]
V4 = int(ip_address("10.0.0.0"))
V6 = int(ip_address("2001:db8::"))

hosts = st.builds(lambda wild, base: f"*.{base}" if wild else base, st.booleans(), st.sampled_from(BASES))
v4_networks = st.builds(lambda offset, prefix: IPv4Network((V4 + offset, prefix), strict=False),
                        st.integers(0, 2**18 - 1), st.integers(14, 32))
v6_networks = st.builds(lambda offset, prefix: IPv6Network((V6 + (offset << 80), prefix), strict=False),
                        st.integers(0, 2**14 - 1), st.integers(32, 128))
networks = st.one_of(v4_networks, v6_networks, st.just(ip_network("0.0.0.0/0")))
port_sets = st.frozensets(st.sampled_from(PORTS), min_size=1)
protocols = st.sampled_from(["tcp", "udp"])
rules = st.one_of(
    st.builds(lambda host, ports, proto: Rule(ports, proto, host=host), hosts, port_sets, protocols),
    st.builds(lambda net, ports, proto: Rule(ports, proto, network=net), networks, port_sets, protocols),
)
policies = st.builds(lambda mode, rs: Policy(mode=mode, rules=tuple(rs)),
                     st.sampled_from(["block", "audit"]), st.lists(rules, max_size=8))

names = st.builds(lambda prefix, base: ".".join([*prefix, base]),
                  st.lists(st.sampled_from(["a", "b", "c", "www"]), max_size=2), st.sampled_from(BASES))
addresses = st.one_of(st.builds(lambda n: ip_address(V4 + n), st.integers(0, 2**18 - 1)),
                      st.builds(lambda n: ip_address(V6 + (n << 80)), st.integers(0, 2**14 - 1)))
flows = st.tuples(st.sampled_from(PORTS), protocols, names, addresses)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 70000), st.floats(allow_nan=False),
                    st.text(max_size=20), st.sampled_from(["block", "audit", "tcp", "udp", "*.example.org",
                                                           "pypi.org", "10.0.0.0/8", "1.2.3.4/8", "*.", "::1/128"]))
keys = st.one_of(st.sampled_from(TOP_KEYS + RULE_KEYS), st.text(max_size=8))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                           st.dictionaries(keys, inner, max_size=5)),
                         max_leaves=30)


def loads_or_reports(text: str) -> None:
    try:
        result = load_policy(text, "fuzz.yml")
    except PolicyError as exc:
        assert exc.problems and all(p.file == "fuzz.yml" for p in exc.problems)
        assert all(p.line >= 0 and p.column >= 0 and p.message for p in exc.problems)
    else:
        assert isinstance(result, Policy)


@SETTINGS
@given(documents)
def test_any_yaml_structure_gives_a_policy_or_a_policy_error(document):
    loads_or_reports(yaml.safe_dump(document))


@SETTINGS
@given(st.text(st.characters(codec=None, categories=None, exclude_categories=()), max_size=300))
def test_any_text_gives_a_policy_or_a_policy_error(text: str):
    loads_or_reports(text)


@SETTINGS
@given(policies, st.data())
def test_mutated_valid_files_give_a_policy_or_a_policy_error(policy: Policy, data):
    text = yaml.safe_dump(policy.canonical())
    position = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, 5))
    insert = data.draw(st.text(alphabet="{}[]:-,'\"&*!%@`#|> \n\t0123456789abc", max_size=5))
    loads_or_reports(text[:position] + insert + text[position + cut:])


@SETTINGS
@given(policies)
def test_valid_policies_round_trip_through_yaml(policy: Policy):
    assert load_policy(yaml.safe_dump(policy.canonical())) == policy


@SETTINGS
@given(policies, st.lists(st.builds(lambda net, ports: Rule(ports, network=net), networks, port_sets), max_size=3))
def test_every_forward_chain_ends_in_the_verdict(policy: Policy, operator_rules):
    rendered = render(policy, CONTEXT, OperatorAllowances(tuple(operator_rules)))
    forward4 = [line for line in rendered.ipv4.splitlines() if line.startswith("-A FORWARD")]
    forward6 = [line for line in rendered.ipv6.splitlines() if line.startswith("-A FORWARD")]
    if policy.mode == "block":
        assert forward4[-1] == "-A FORWARD -j REJECT --reject-with icmp-admin-prohibited"
        assert forward6[-1] in ("-A FORWARD -j REJECT --reject-with icmp6-adm-prohibited", "-A FORWARD -j DROP")
    else:
        assert forward4[-2:] == [f'-A FORWARD {LIMIT} -j NFLOG --nflog-group 100 --nflog-prefix "mvc"', "-A FORWARD -j ACCEPT"]
    for document in (rendered.ipv4, rendered.ipv6):
        assert all(line.startswith(("#", "*filter", ":", "-A ", "COMMIT")) for line in document.splitlines())
        assert ":FORWARD DROP [0:0]" in document and document.rstrip().endswith("COMMIT")


def effective(policy: Policy, flow) -> bool:
    port, protocol, name, address = flow
    return policy.mode == "audit" or policy.allows(port, protocol, name=name, address=address)


@SETTINGS
@given(policies, policies, st.lists(flows, min_size=1, max_size=20))
def test_intersection_is_never_wider_than_either_side(a: Policy, b: Policy, sample):
    both = intersect(a, b)
    assert both.mode == ("audit" if a.mode == b.mode == "audit" else "block")
    for port, protocol, name, address in sample:
        if both.allows(port, protocol, name=name, address=address):
            assert a.allows(port, protocol, name=name, address=address)
            assert b.allows(port, protocol, name=name, address=address)
        if effective(both, (port, protocol, name, address)):
            assert effective(a, (port, protocol, name, address)) and effective(b, (port, protocol, name, address))


@SETTINGS
@given(policies, policies, st.lists(flows, min_size=1, max_size=20))
def test_intersection_keeps_what_both_sides_allow_in_the_same_terms(a: Policy, b: Policy, sample):
    """Exactness apart from the documented host-versus-network case."""
    both = intersect(a, b)
    for port, protocol, name, address in sample:
        by_name = all(Policy(rules=p.host_rules).allows(port, protocol, name=name) for p in (a, b))
        by_address = all(Policy(rules=p.network_rules).allows(port, protocol, address=address) for p in (a, b))
        if by_name:
            assert both.allows(port, protocol, name=name)
        if by_address:
            assert both.allows(port, protocol, address=address)


@SETTINGS
@given(policies, policies)
def test_intersection_is_commutative_and_idempotent(a: Policy, b: Policy):
    assert intersect(a, b) == intersect(b, a)
    assert intersect(a, a) == a
    assert intersect(a, b).digest() == intersect(b, a).digest()
