"""The operator's block list: names and networks no job may reach, in any mode, whatever its policy.

A plain text file named by the service config (`network.block_list`), one entry a line, `#` starts
a comment: a DNS name (`evil.example`: that name and every name under it, as malware feeds mean
their domains), a wildcard (`*.evil.example`: only the names under it), or an address or network
(`198.51.100.7`, `198.51.100.0/24`, IPv6 alike). It is the operator's, never a repository's, so it
wins over every allow rule and over audit mode: the resolver refuses a blocked name (NXDOMAIN) and
every answer pointing into a blocked network, the name check refuses a blocked SNI or Host, and the
rendered FORWARD chain rejects the networks before any allowance (`policy.render`). Each refusal is
recorded with reason `policy.suggest.BLOCK_LISTED`, which a suggestion never turns into a rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from pathlib import Path

from policy.load import host_error
from policy.model import Address, Network, host_matches
from runner.errors import ConfigError

MAX_BYTES = 16 * 1024 * 1024  # a large public feed has ~10^5 entries
MAX_ENTRIES = 200_000
MAX_PROBLEMS = 20


class BlockListError(ConfigError):
    """The block list file is unreadable or has bad entries; `str()` lists them as file:line: problem."""


@dataclass(frozen=True)
class BlockList:
    """Names (exact: the name and below it; `*.` wildcards: below it) and networks."""

    names: frozenset[str] = frozenset()
    wildcards: tuple[str, ...] = ()
    networks: tuple[Network, ...] = ()

    def blocks_name(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        labels = name.split(".")
        if any(".".join(labels[at:]) in self.names for at in range(len(labels))):
            return True
        return any(host_matches(pattern, name) for pattern in self.wildcards)

    def blocks_address(self, address: Address | str) -> bool:
        parsed = ip_address(address)
        return any(parsed.version == network.version and parsed in network for network in self.networks)

    def __bool__(self) -> bool:
        return bool(self.names or self.wildcards or self.networks)


EMPTY = BlockList()


def load_block_list(path: Path) -> BlockList:
    """Read the block list at `path`; BlockListError naming every bad line (up to MAX_PROBLEMS)."""
    try:
        with path.open("rb") as source:
            data = source.read(MAX_BYTES + 1)
    except OSError as exc:
        raise BlockListError(f"{path}: cannot read the block list: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise BlockListError(f"{path}: the block list is larger than {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BlockListError(f"{path}: the block list is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_block_list(text, str(path))


def parse_block_list(text: str, source: str = "<block list>") -> BlockList:
    names: set[str] = set()
    wildcards: list[str] = []
    networks: list[Network] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if len(names) + len(wildcards) + len(networks) >= MAX_ENTRIES:
            problems.append(f"{source}:{number}: more than {MAX_ENTRIES} entries; split the feed or aggregate networks")
            break
        network = _network(entry)
        if network is not None:
            networks.append(network)
        elif (error := host_error(entry)) is None:
            (wildcards.append(entry.lower()) if entry.startswith("*.") else names.add(entry.lower()))
        elif not any(char.isalpha() for char in entry) or "/" in entry:
            problems.append(f"{source}:{number}: {entry[:60]!r} is not an address or network (like 198.51.100.0/24)")
        else:
            problems.append(f"{source}:{number}: {error}")
        if len(problems) >= MAX_PROBLEMS:
            break
    if problems:
        raise BlockListError("\n".join(problems))
    return BlockList(frozenset(names), tuple(wildcards), tuple(networks))


def _network(entry: str) -> Network | None:
    try:
        return ip_network(entry, strict=False)
    except ValueError:
        return None
