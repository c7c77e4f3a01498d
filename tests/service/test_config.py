"""Config validation: every mistake names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.service.config import ConfigError, load_config, parse_size


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "service.yml"
    path.write_text(text)
    return path


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "state_dir: state\npolicy_dir: policies\n"))
    assert config.state_dir == tmp_path / "state"
    assert config.policy_dir == tmp_path / "policies"
    assert config.jobs_dir == tmp_path / "state" / "jobs"
    assert config.default_template == "base"
    assert config.listen is None and config.token is None


def test_full_config(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token-0123456789\n")
    config = load_config(write(tmp_path, """
socket: /tmp/x.sock
socket_group: users
listen: 127.0.0.1:8470
token_file: token
templates: [base, big]
resources: {vcpus: 2, memory_mib: 1024}
max_concurrent_jobs: 4
max_queued_jobs: 10
checkout_max_bytes: 200MiB
artifacts: {max_count: 5, max_total_bytes: 1G}
logs: {max_bytes: 1MiB}
retention: {days: 3, max_records: 100}
prewarm: {max_vms: 1, expire_seconds: 60}
webhook: {listen: "127.0.0.1:9000", secret_path: /etc/secret}
"""))
    assert config.listen == ("127.0.0.1", 8470)
    assert config.token == "s3cret-token-0123456789"
    assert config.templates == ("base", "big")
    assert config.resources.vcpus == 2 and config.resources.memory_mib == 1024
    assert config.checkout_max_bytes == 200 * 1024**2
    assert config.artifacts.max_total_bytes == 1024**3
    assert config.logs.max_bytes == 1024**2
    assert config.retention.days == 3.0
    assert config.webhook == {"listen": "127.0.0.1:9000", "secret_path": "/etc/secret"}


@pytest.mark.parametrize("text, where", [
    ("max_concurrent_jobs: 0\n", "max_concurrent_jobs: must be at least 1"),
    ("max_queued_jobs: many\n", "max_queued_jobs: expected an integer"),
    ("checkout_max_bytes: 12 parsecs\n", "checkout_max_bytes: expected a size"),
    ("artifacts: {max_cuont: 3}\n", "artifacts.max_cuont: unknown setting"),
    ("sockit: /x\n", "sockit: unknown setting"),
    ("listen: 127.0.0.1:8470\n", "listen: TCP needs a bearer token"),
    ("listen: 127.0.0.1:8470\ntoken: short\n", "listen: TCP needs a bearer token"),
    ("listen: nowhere\n", "listen: expected HOST:PORT"),
    ("templates: []\n", "templates: expected a non-empty list"),
    ("resources: 3\n", "resources: expected a mapping"),
    ("default_timeout_seconds: 100\nmax_timeout_seconds: 10\n", "default_timeout_seconds: larger than"),
    ("- a list\n", "expected a mapping of settings"),
    ("a: [unclosed\n", "not valid YAML"),
    ("token_file: missing-token\n", "token_file: cannot read"),
])
def test_errors_name_file_and_key(tmp_path: Path, text: str, where: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(str(path))
    assert where in str(err.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.yml: cannot read"):
        load_config(tmp_path / "missing.yml")


@pytest.mark.parametrize("value, expected", [(0, 0), (4096, 4096), ("1K", 1024), ("2MiB", 2 * 1024**2),
                                             ("3 GB", 3 * 1024**3), ("7", 7), ("5B", 5)])
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", [-1, True, "1.5G", "ten", "1X"])
def test_bad_sizes(value: object) -> None:
    with pytest.raises(ConfigError, match="^x: "):
        parse_size(value, "x")


def test_network_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "network: {enabled: true, uplink_interface: eth1, slot_prefix: job, slots: 2}\n"))
    assert (config.network.enabled, config.network.uplink_interface, config.network.slot_prefix,
            config.network.slots) == (True, "eth1", "job", 2)
    assert load_config(write(tmp_path, "{}\n")).network.enabled is False
    with pytest.raises(ConfigError, match="network.enabled: expected true or false"):
        load_config(write(tmp_path, "network: {enabled: yes please}\n"))
    with pytest.raises(ConfigError, match="network.slot_prefix: 1-9 lowercase"):
        load_config(write(tmp_path, "network: {slot_prefix: Bad-Prefix}\n"))


def test_operator_allowances(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "network:\n  enabled: true\n  allow:\n"
                                         "    - {cidr: 169.254.169.254/32, ports: [80]}\n"
                                         "    - {cidr: 10.0.0.0/24, ports: [53], protocol: udp}\n"))
    assert [(str(r.network), sorted(r.ports), r.protocol) for r in config.network.allow.rules] == [
        ("169.254.169.254/32", [80], "tcp"), ("10.0.0.0/24", [53], "udp")]
    assert load_config(write(tmp_path, "network: {enabled: true}\n")).network.allow.rules == ()


@pytest.mark.parametrize("allow, message", [
    ("allow: {cidr: 10.0.0.1/32}", "network.allow: expected a list of rules"),
    ("allow: [10.0.0.1/32]", "network.allow[0]: expected a mapping"),
    ("allow: [{host: pypi.org, ports: [443]}]", "network.allow[0].host: unknown key"),
    ("allow: [{ports: [443]}]", "network.allow[0].cidr: missing"),
    ("allow: [{cidr: 10.0.0.1/24, ports: [443]}]", "network.allow[0].cidr: 10.0.0.1/24 has host bits set"),
    ("allow: [{cidr: 10.0.0.0/24, ports: 443}]", "network.allow[0].ports: expected a list"),
    ("allow: [{cidr: 10.0.0.0/24, ports: [0]}]", "network.allow[0]: a Rule needs integer ports"),
    ("allow: [{cidr: 10.0.0.0/24, ports: ['443']}]", "network.allow[0]: a Rule needs integer ports"),
    ("allow: [{cidr: 10.0.0.0/24, ports: [443], protocol: icmp}]", "network.allow[0]: protocol must be one of"),
])
def test_bad_operator_allowances_name_the_rule(tmp_path: Path, allow: str, message: str) -> None:
    path = write(tmp_path, f"network:\n  enabled: true\n  {allow}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {message}")


def test_operator_allowances_need_networking(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="network.allow: has no effect while network.enabled is false"):
        load_config(write(tmp_path, "network:\n  allow: [{cidr: 10.0.0.0/24, ports: [443]}]\n"))


def test_the_webhook_section_is_checked_when_the_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "webhook: {listen: '127.0.0.1:8471', secret_path: secret, "
                                         "github_config: gh/app.yml}\n"))
    assert config.webhook["secret_path"] == str(tmp_path / "secret")  # relative to the config, like token_file
    assert config.webhook["github_config"] == str(tmp_path / "gh" / "app.yml")
    with pytest.raises(ConfigError, match="webhook.lisen: unknown setting"):  # a typo must not turn it off
        load_config(write(tmp_path, "webhook: {lisen: '127.0.0.1:8471'}\n"))
    with pytest.raises(ConfigError, match="webhook.listen: expected HOST:PORT"):
        load_config(write(tmp_path, "webhook: {listen: '127.0.0.1:99999'}\n"))
