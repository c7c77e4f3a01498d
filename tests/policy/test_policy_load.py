"""Loading policy files: valid files give the expected Policy, every error class names file:line:col."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest

from policy import Policy, PolicyError, Rule, load_policy
from policy.load import MAX_BYTES, MAX_PORTS_PER_RULE, MAX_PROBLEMS, MAX_RULES

NAME = "repo/.github/microvm-check.yml"

VALID = """\
version: 1
mode: block              # or audit
allow:
  - host: pypi.org
    ports: [443]
  - host: "*.pythonhosted.org"
    ports: [443]
  - cidr: 10.20.0.0/16
    ports: [80, 443]
    protocol: tcp
  - cidr: "2001:db8::/32"
    ports: [53]
    protocol: udp
"""


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(text, NAME)
    return [str(problem) for problem in caught.value.problems]


def test_valid_policy_loads_into_the_model():
    policy = load_policy(VALID, NAME)
    assert policy == Policy(version=1, mode="block", rules=(
        Rule(frozenset({443}), "tcp", host="pypi.org"),
        Rule(frozenset({443}), "tcp", host="*.pythonhosted.org"),
        Rule(frozenset({80, 443}), "tcp", network=ip_network("10.20.0.0/16")),
        Rule(frozenset({53}), "udp", network=ip_network("2001:db8::/32")),
    ))


def test_defaults_are_block_mode_tcp_and_no_rules():
    policy = load_policy("version: 1\nallow:\n  - host: PyPI.org\n    ports: [443]\n")
    assert policy.mode == "block"
    assert policy.rules == (Rule(frozenset({443}), "tcp", host="pypi.org"),)
    assert load_policy("version: 1\n").rules == ()
    assert load_policy("version: 1\nallow:\n").rules == ()


def test_loads_from_a_path_and_reports_against_it(tmp_path: Path):
    path = tmp_path / "p.yml"
    path.write_text("version: 1\nmode: audit\n")
    assert load_policy(path).mode == "audit"
    path.write_text("version: 1\nmode: loud\n")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert str(caught.value) == f"{path}:2:7: mode: 'loud' is not a mode; use block or audit"


def test_port_out_of_range_names_line_and_column():
    text = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443, 70000]\n"
    assert problems(text) == [f"{NAME}:4:18: ports: 70000 is out of range; use 1..65535"]


def test_port_zero_and_non_integers():
    text = "version: 1\nallow:\n  - cidr: 10.0.0.0/8\n    ports: [0, '443', 4.5, true]\n"
    assert problems(text) == [
        f"{NAME}:4:13: ports: 0 is out of range; use 1..65535",
        f"{NAME}:4:16: ports: '443' is not a port number (a decimal integer 1..65535); write 443 without quotes",
        f"{NAME}:4:23: ports: '4.5' is not a port number (a decimal integer 1..65535)",
        f"{NAME}:4:28: ports: 'true' is not a port number (a decimal integer 1..65535)",
    ]


def test_ports_must_be_plain_decimal_not_yaml_octal_hex_or_base_60():
    text = "version: 1\nallow:\n  - cidr: 10.0.0.0/8\n    ports: [0443, 0x1bb, 7:23, 1_000]\n"
    assert problems(text) == [
        f"{NAME}:4:13: ports: '0443' is not a port number (a decimal integer 1..65535); write 443 without leading zeros",
        f"{NAME}:4:19: ports: '0x1bb' is not a port number (a decimal integer 1..65535)",
        f"{NAME}:4:26: ports: '7:23' is not a port number (a decimal integer 1..65535)",
        f"{NAME}:4:32: ports: '1_000' is not a port number (a decimal integer 1..65535)",
    ]


def test_a_flood_of_problems_is_capped_and_says_so():
    rules = "".join(f"  - cidr: 10.0.0.{i}/8\n    ports: [443]\n" for i in range(1, 151))
    found = problems("version: 1\nallow:\n" + rules)
    assert len(found) == MAX_PROBLEMS + 1
    assert found[-1] == f"{NAME}: 50 more problems not shown; fix the ones above first"


def test_ports_missing_empty_or_not_a_list():
    text = ("version: 1\nallow:\n  - host: a.example\n"
            "  - host: b.example\n    ports: []\n"
            "  - host: c.example\n    ports: 443\n")
    assert problems(text) == [
        f"{NAME}:3:5: an allow entry needs 'ports', e.g. ports: [443]",
        f"{NAME}:5:12: ports is empty; list at least one port, e.g. [443]",
        f"{NAME}:7:12: ports must be a list; write ports: [443]",
    ]


def test_unknown_key_suggests_the_closest_known_key():
    text = "version: 1\nmdoe: audit\nallow:\n  - host: pypi.org\n    prots: [443]\n    colour: red\n"
    assert problems(text) == [
        f"{NAME}:2:1: unknown key 'mdoe' in the policy; did you mean 'mode'?",
        f"{NAME}:4:5: an allow entry needs 'ports', e.g. ports: [443]",
        f"{NAME}:5:5: unknown key 'prots' in an allow entry; did you mean 'ports'?",
        f"{NAME}:6:5: unknown key 'colour' in an allow entry; known keys: host, cidr, ports, protocol, raw, methods, paths",
    ]


def test_bad_cidrs():
    text = ("version: 1\nallow:\n"
            "  - cidr: 10.20.0.1/16\n    ports: [80]\n"
            "  - cidr: 10.300.0.0/16\n    ports: [80]\n"
            "  - cidr: 10.0.0.0/33\n    ports: [80]\n"
            "  - cidr: [10.0.0.0/8]\n    ports: [80]\n")
    assert problems(text) == [
        f"{NAME}:3:11: cidr: '10.20.0.1/16' has host bits set; did you mean 10.20.0.0/16?",
        f"{NAME}:5:11: cidr: '10.300.0.0/16' is not a network; write one like 10.20.0.0/16 or 2001:db8::/32",
        f"{NAME}:7:11: cidr: '10.0.0.0/33' is not a network; write one like 10.20.0.0/16 or 2001:db8::/32",
        f"{NAME}:9:11: cidr: a list is not a network; write one like 10.20.0.0/16 (in quotes if needed)",
    ]


@pytest.mark.parametrize("cidr, what", [
    ("169.254.169.254/32", "link-local"),
    ("127.0.0.0/16", "loopback"),
    ("224.0.0.1/32", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("'::1/128'", "IPv6 loopback"),
    ("'fe80::/64'", "IPv6 link-local"),
    ("'::ffff:10.0.0.0/104'", "IPv4-mapped IPv6"),
])
def test_cidr_inside_an_always_denied_range_is_rejected(cidr: str, what: str):
    [message] = problems(f"version: 1\nallow:\n  - cidr: {cidr}\n    ports: [80]\n")
    assert message.startswith(f"{NAME}:3:11: cidr: ")
    assert f"lies inside {what}" in message and "operator" in message


def test_cidr_merely_overlapping_a_denied_range_is_kept_and_clipped_when_rendered():
    policy = load_policy("version: 1\nallow:\n  - cidr: 0.0.0.0/0\n    ports: [443]\n")
    assert policy.rules[0].network == ip_network("0.0.0.0/0")


@pytest.mark.parametrize("host, message", [
    ("'a.*.example.org'", "'a.*.example.org' is a bad wildcard; only a leading '*.' label is allowed"),
    ("'*example.org'", "'*example.org' is a bad wildcard"),
    ("'*.*.example.org'", "'*.*.example.org' is a bad wildcard"),
    ("'*.org'", "'*.org' would match a whole top-level domain"),
    ("'*.'", "'*.' would match a whole top-level domain"),
    ("1.2.3.4", "'1.2.3.4' is an IP address; use cidr: 1.2.3.4/32 instead"),
    ("pypi.org.", "'pypi.org.' ends with a dot; drop the trailing dot"),
    ("under_score.example", "'under_score.example' has an invalid label 'under_score'"),
    ("-bad.example", "'-bad.example' has an invalid label '-bad'"),
    ("a..example", "'a..example' has an invalid label ''"),
    ("example.123", "'example.123' ends in a numeric label"),
    ("443", "'443' is not a host name"),
])
def test_bad_hosts_and_wildcards(host: str, message: str):
    [found] = problems(f"version: 1\nallow:\n  - host: {host}\n    ports: [443]\n")
    assert found.startswith(f"{NAME}:3:11: host: {message}")


def test_long_label_and_long_name():
    long_label = "a" * 64 + ".example"
    assert "invalid label" in problems(f"version: 1\nallow:\n  - host: {long_label}\n    ports: [1]\n")[0]
    long_name = ".".join(["a" * 60] * 5)
    assert "1..253 characters" in problems(f"version: 1\nallow:\n  - host: {long_name}\n    ports: [1]\n")[0]


def test_host_and_cidr_together_or_neither():
    text = ("version: 1\nallow:\n"
            "  - host: pypi.org\n    cidr: 10.0.0.0/8\n    ports: [443]\n"
            "  - ports: [443]\n"
            "  - just-a-string\n")
    assert problems(text) == [
        f"{NAME}:3:5: an allow entry has both 'host' and 'cidr'; split it into two entries",
        f"{NAME}:6:5: an allow entry needs 'host' (a DNS name) or 'cidr' (a network)",
        f"{NAME}:7:5: an allow entry must be a mapping like {{host: pypi.org, ports: [443]}}, not 'just-a-string'",
    ]


def test_bad_protocol():
    text = "version: 1\nallow:\n  - cidr: 10.0.0.0/8\n    ports: [1]\n    protocol: icmp\n"
    assert problems(text) == [f"{NAME}:5:15: protocol: 'icmp' is not supported; use tcp or udp"]


@pytest.mark.parametrize("text, message", [
    ("mode: block\n", "1:1: missing 'version'; add 'version: 1' at the top"),
    ("version: 2\n", "1:10: version: 2 is not supported; this runner reads version 1"),
    ("version: '1'\n", "1:10: version: '1' is not a version; use version: 1 (a number)"),
    ("version: [1]\n", "1:10: version: a list is not a version; use version: 1 (a number)"),
])
def test_wrong_or_missing_version(text: str, message: str):
    assert problems(text) == [f"{NAME}:{message}"]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(text: str):
    [message] = problems(text)
    assert message.startswith(f"{NAME}:1:1: the policy is empty; write 'version: 1'")


@pytest.mark.parametrize("text, kind", [("- version: 1\n", "a list"), ("just text\n", "'just text'"),
                                        ("42\n", "'42'")])
def test_not_a_mapping(text: str, kind: str):
    [message] = problems(text)
    assert message.startswith(f"{NAME}:1:1: the policy must be a mapping with keys version, mode and allow, not {kind}")


def test_duplicate_keys_are_detected_not_silently_collapsed():
    text = ("version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n"
            "mode: audit\nallow:\n  - host: evil.example\n    ports: [443]\n    ports: [22]\n")
    assert problems(text) == [
        f"{NAME}:6:1: duplicate key 'allow' (first on line 2); YAML would silently keep only the last one: merge them into one",
        f"{NAME}:9:5: duplicate key 'ports' (first on line 8); YAML would silently keep only the last one: merge them into one",
    ]


@pytest.mark.parametrize("text, location", [
    ("version: 1\nallow: [\n", "3:1"),
    ("version: 1\n  mode: block\n", "2:7"),
    ("version: 1\nmode: 'block\n", "3:1"),
    ("version: 1\n---\nversion: 1\n", "2:1"),
    ("version: 1\nallow: [{host: a.example, ports: [1]}\n", "3:1"),
])
def test_yaml_syntax_errors(text: str, location: str):
    [found] = problems(text)
    assert found.startswith(f"{NAME}:{location}: YAML syntax error: ")
    assert found.endswith("; fix the YAML (indentation, quotes, colons)")


def test_non_printable_character():
    assert problems("version: 1\nmode: \x07block\n") == [
        f"{NAME}:2:7: the policy contains a character YAML does not allow (U+0007); remove it"]


def test_text_that_is_not_valid_unicode():
    assert problems("version: 1\nmode: \ud800\n") == [
        f"{NAME}:2:7: the policy is not valid Unicode text; save it as UTF-8"]


def test_aliases_are_refused():
    text = "version: 1\nallow:\n  - &web {host: pypi.org, ports: [443]}\n  - *web\n"
    assert problems(text) == [f"{NAME}:4:5: YAML aliases (*name) are not allowed in a policy; write the entry out in full"]


def test_deep_nesting_is_refused_without_recursion():
    [message] = problems("version: 1\nallow: " + "[" * 100 + "]" * 100 + "\n")
    assert message == (f"{NAME}:2:23: the policy is nested deeper than 16 levels; "
                       "a policy is a mapping with a list of flat entries")
    [message] = problems("version: 1\nallow: " + "[" * 50000 + "]" * 50000 + "\n")
    assert message.startswith(f"{NAME}:2:")


def test_oversized_text_and_file(tmp_path: Path):
    big = "version: 1\n" + "#" * MAX_BYTES
    assert "larger than" in problems(big)[0]
    path = tmp_path / "big.yml"
    path.write_text(big)
    with pytest.raises(PolicyError, match=rf"^{path}: the policy is larger than {MAX_BYTES} bytes"):
        load_policy(path)


def test_too_many_rules_and_ports():
    rules = "".join(f"  - cidr: 10.0.{i // 256}.{i % 256}/32\n    ports: [443]\n" for i in range(MAX_RULES + 1))
    assert problems("version: 1\nallow:\n" + rules) == [
        f"{NAME}:3:3: allow has {MAX_RULES + 1} entries; at most {MAX_RULES} are allowed: use wildcards or wider networks"]
    ports = ", ".join(str(p) for p in range(1, MAX_PORTS_PER_RULE + 2))
    [message] = problems(f"version: 1\nallow:\n  - host: a.example\n    ports: [{ports}]\n")
    assert message.startswith(f"{NAME}:4:12: ports lists {MAX_PORTS_PER_RULE + 1} ports")


def test_unreadable_and_non_utf8_files(tmp_path: Path):
    with pytest.raises(PolicyError, match=r"missing.yml: cannot read the policy: No such file"):
        load_policy(tmp_path / "missing.yml")
    path = tmp_path / "latin1.yml"
    path.write_bytes(b"version: 1\nmode: bl\xe9ck\n")
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert str(caught.value) == f"{path}:2:9: the policy is not UTF-8 text; save it as UTF-8"


def test_all_problems_are_reported_in_file_order():
    text = ("version: 3\nmode: loud\nallow:\n"
            "  - host: 'bad*'\n    ports: [0]\n"
            "  - cidr: 1.2.3.4/8\n    ports: [99999]\n    protocol: sctp\n")
    found = problems(text)
    assert [message.split(": ")[0] for message in found] == [
        f"{NAME}:1:10", f"{NAME}:2:7", f"{NAME}:4:11", f"{NAME}:5:13", f"{NAME}:6:11", f"{NAME}:7:13", f"{NAME}:8:15"]


def test_untrusted_values_are_quoted_and_cut_short_in_messages():
    [message] = problems("version: 1\nmode: '" + "x" * 5000 + "\\nFAKE:1:1: injected'\n")
    assert len(message) < 200 and "\n" not in message
