"""Config validation: every mistake of a file at once, each with its file:line:col and key; nothing but
`ConfigError` ever comes out, however hostile the file (issue 13, item 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from runner.cli import main
from runner.service.config.reading import ConfigError, config_from_mapping, load_config, parse_size
from runner.service.config.schema import schema_text
from runner.service.config.settings import ServiceConfig, WebhookSettings

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = ROOT / "docs" / "service-config.schema.json"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "service.yml"
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value).splitlines()


def docs_example(tmp_path: Path) -> str:
    """The service config example in docs/job-api.md, its /etc paths moved under `tmp_path` (with a token file)."""
    text = (ROOT / "docs" / "job-api.md").read_text()
    block = re.search(r"## Service config.*?```yaml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "api-token").write_text("docs-example-token-0123456789\n")
    return block.replace("/etc/microvm-check/", f"{tmp_path}/")


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "state_dir: state\npolicy_dir: policies\n"))
    assert config.state_dir == tmp_path / "state"
    assert config.policy_dir == tmp_path / "policies"
    assert config.jobs_dir == tmp_path / "state" / "jobs"
    assert config.default_template == "base"
    assert config.listen is None and config.token is None


def test_each_default_has_one_source(tmp_path: Path) -> None:
    """The loader's defaults are the dataclasses' own: an empty file, `{}` and `ServiceConfig()` agree."""
    assert load_config(write(tmp_path, "")) == config_from_mapping({}) == ServiceConfig()
    defaults = json.loads(schema_text())["properties"]
    assert defaults["max_queued_jobs"]["default"] == ServiceConfig().max_queued_jobs
    assert defaults["webhook"]["properties"]["labels"]["default"] == list(WebhookSettings().labels)


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
webhook: {listen: "127.0.0.1:9000", secret_path: /etc/secret, redeliver_every: 300}
"""))
    assert config.listen == ("127.0.0.1", 8470)
    assert config.token == "s3cret-token-0123456789"
    assert config.templates == ("base", "big")
    assert config.resources.vcpus == 2 and config.resources.memory_mib == 1024
    assert config.checkout_max_bytes == 200 * 1024**2
    assert config.artifacts.max_total_bytes == 1024**3
    assert config.logs.max_bytes == 1024**2
    assert config.retention.days == 3.0
    assert config.webhook == WebhookSettings(listen=("127.0.0.1", 9000), secret_path=Path("/etc/secret"),
                                             redeliver_every=300.0)


def test_the_example_in_the_docs_loads_and_fits_the_schema(tmp_path: Path) -> None:
    text = docs_example(tmp_path)
    config = load_config(write(tmp_path, text))
    assert config.network.enabled and [str(r.network) for r in config.network.allow.rules] == ["10.0.0.5/32"]
    assert config.token == "docs-example-token-0123456789"
    jsonschema.validate(yaml.safe_load(text), json.loads(SCHEMA.read_text()))


def test_the_published_schema_is_the_one_the_code_makes() -> None:
    assert SCHEMA.read_text() == schema_text(), "regenerate it: microvm-check config schema > " + str(SCHEMA)
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("change, message", [
    ("max_concurrent_jobs: 0", "max_concurrent_jobs: must be at least 1, not 0"),
    ("max_queued_jobs: 1000000000000", "max_queued_jobs: must be at most 100000, not 1000000000000"),
    ("checkout_wait_seconds: ten", "checkout_wait_seconds: expected a number, not 'ten'"),
    ("shutdown_grace_seconds: .inf", "shutdown_grace_seconds: must be a finite number, not '.inf'"),
    ("sockit: /x", "sockit: unknown setting (a typo?); did you mean 'socket'?"),
    ("artifacts: {max_cuont: 3}", "artifacts.max_cuont: unknown setting (a typo?); did you mean 'max_count'?"),
    ("resources: 3", "resources: expected a mapping of settings (key: value), not '3'"),
    ("templates: []", "templates: expected a list of 1 to 64 strings, not a list of 0"),
    ("network: {enabled: yes please}", "network.enabled: expected true or false, not 'yes please'"),
    ("network: {slot_prefix: Bad-Prefix}", "network.slot_prefix: 'Bad-Prefix' does not fit"),
    ("webhook: {listen: '127.0.0.1:8471', lisen: x}", "webhook.lisen: unknown setting"),
])
def test_the_schema_and_the_loader_refuse_the_same_files(tmp_path: Path, change: str, message: str) -> None:
    path = write(tmp_path, "templates: [base]\n" + change + "\n" if not change.startswith("templates") else change)
    [problem] = [p for p in problems(path) if "secret_path" not in p]
    assert problem.startswith(f"{path}:") and message in problem
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(path.read_text()), json.loads(SCHEMA.read_text()))


def test_every_problem_is_reported_at_once_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "max_concurrent_jobs: 0\nsockit: 1\nnetwork:\n  slots: -1\n  allow: 7\n"
                           "listen: nowhere\nretention: {days: -1}\n")
    assert problems(path) == [
        f"{path}:1:22: max_concurrent_jobs: must be at least 1, not 0",
        f"{path}:2:1: sockit: unknown setting (a typo?); did you mean 'socket'?",
        f"{path}:4:10: network.slots: must be at least 0, not -1",
        f"{path}:5:10: network.allow: expected a list of at most 256 rules like {{cidr: 10.0.0.5/32, ports: "
        "[3128]}, not '7'",
        f"{path}:6:9: listen: expected HOST:PORT like 127.0.0.1:8470, not 'nowhere'",
        f"{path}:7:19: retention.days: must be at least 0, not -1",
    ]


def test_settings_that_need_each_other_point_at_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, "default_timeout_seconds: 100\nmax_timeout_seconds: 10\nlisten: 127.0.0.1:8470\n"
                           "token: short\nwebhook:\n  listen: 0.0.0.0:8471\n")
    assert problems(path) == [
        f"{path}:1:26: default_timeout_seconds: larger than max_timeout_seconds (10)",
        f"{path}:3:9: listen: TCP needs a bearer token of at least 16 characters (token or token_file)",
        f"{path}:6:11: webhook.listen: webhook.secret_path: required when listen is set "
        "(a file holding the webhook secret)",
    ]
    [problem] = problems(write(tmp_path, "token_file: missing-token\n"))
    assert problem.startswith(f"{path}:1:13: token_file: cannot read '{tmp_path}/missing-token'")


# -- issue 13, item 6: the exact inputs that gave tracebacks, hangs or huge messages ------------------


def laughs(levels: int) -> str:
    """Billion laughs in the `templates` field: each level a list of nine aliases of the one before."""
    lines = ["templates:", "  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefg", "bcdefgh"[: levels - 1]):
        lines.append(f"  - &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [7, 8])
def test_billion_laughs_is_refused_in_a_short_message(tmp_path: Path, levels: int) -> None:
    """Before: 8 levels (372 bytes here) ran out of time, 7 gave a 34.7 MB message (the aliases expanded in
    `got {value!r}`). Now the first alias is refused, before anything is built, and the rest counted."""
    path = write(tmp_path, laughs(levels))
    [problem] = problems(path)
    assert problem == (f"{path}:3:9: YAML aliases (*name) are not allowed in a config; write the entry out in full "
                       f"({(levels - 1) * 9 - 1} more aliases after it)")


@pytest.mark.parametrize("text, message", [
    ("1: x\nfoo: y\n", ":1:1: the config keys must be plain names; known keys: socket, "),
    ("foo: y\n1: x\n", ":1:1: foo: unknown setting (a typo?); known keys: socket, "),
    ('state_dir: "a\\0b"\n', ":1:12: state_dir: contains a NUL character: 'a\\x00b'"),
    ("max_queued_jobs: " + "9" * 5000 + "\n", ":1:18: max_queued_jobs: expected an integer in plain decimal digits, "
                                            "not '999999999999999999999999999999999999999999999999999999999...'"),
    ("network: " + "[" * 1000 + "]" * 1000 + "\n", ":1:1009: YAML syntax error: while increasing flow level "
                                                 "exceeded maximum nesting depth"),
    ("templates:\n" + "- " * 1000 + "x\n", ":2:15: the config is nested deeper than 8 levels; a config "
                                          "is a mapping of settings with a few small sections"),
    ("shutdown_grace_seconds: .inf\n", ":1:25: shutdown_grace_seconds: must be a finite number, not '.inf'"),
    ("prewarm:\n  expire_seconds: .inf\n", ":2:19: prewarm.expire_seconds: must be a finite number, not '.inf'"),
    ("checkout_wait_seconds: .nan\n", ":1:24: checkout_wait_seconds: must be a finite number, not '.nan'"),
])
def test_hostile_inputs_give_a_config_error_with_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    problem = problems(path)[0]
    assert problem.startswith(f"{path}{message}")


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "service.yml"
    path.write_bytes(b"max_concurrent_jobs: 2\nsocket: /run/\xff\xfe.sock\n")
    assert problems(path) == [f"{path}:2:14: the config is not UTF-8 text; save it as UTF-8"]


def test_a_large_file_is_not_read(tmp_path: Path) -> None:
    path = write(tmp_path, "# padding\n" * 7000)
    assert problems(path) == [f"{path}: the config is larger than 65536 bytes; a config needs a handful of settings, "
                              "not a file this size"]


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing.yml: cannot read the config: No such file"):
        load_config(tmp_path / "missing.yml")


def test_python_values_are_checked_like_a_file() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: max_concurrent_jobs: must be at least 1, not 0\n"
                                          r"<config>: prewarm.expire_seconds: must be a finite number, not '.inf'$"):
        config_from_mapping({"max_concurrent_jobs": 0, "prewarm": {"expire_seconds": float("inf")}})
    assert config_from_mapping({"state_dir": Path("/x"), "templates": ("a",)}).templates == ("a",)


@pytest.mark.parametrize("value, expected", [("0", 0), ("4096", 4096), ("1K", 1024), ("2MiB", 2 * 1024**2),
                                             ("3 GB", 3 * 1024**3), ("7", 7), ("5B", 5), ("1kib", 1024),
                                             ("1.5GiB", 3 * 1024**3 // 2), ("0.5K", 512), ("2.25 MiB", 9 * 1024**2 // 4)])
def test_sizes(value: str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["-1", "true", "1.5", "0.3K", "1.", ".5G", "ten", "1X", "9" * 16, "1.5.5G"])
def test_bad_sizes(value: str) -> None:
    with pytest.raises(ValueError, match=r"^expected a size like 512MiB, 1\.5GiB or 1G \(whole bytes\), not '"):
        parse_size(value)


def test_a_decimal_size_in_a_config_file(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "checkout_max_bytes: 1.5GiB\n")).checkout_max_bytes == 3 * 1024**3 // 2
    with pytest.raises(ConfigError, match=r"service.yml:1:19: logs.max_bytes: expected a size like 512MiB, 1\.5GiB or 1G "
                                          r"\(whole bytes\), not '0\.3K'$"):
        load_config(write(tmp_path, "logs: {max_bytes: 0.3K}\n"))


def test_network_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "network: {enabled: true, uplink_interface: eth1, slot_prefix: job, slots: 2}\n"))
    assert (config.network.enabled, config.network.uplink_interface, config.network.slot_prefix,
            config.network.slots) == (True, "eth1", "job", 2)
    assert load_config(write(tmp_path, "{}\n")).network.enabled is False


def test_operator_allowances(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "network:\n  enabled: true\n  allow:\n"
                                         "    - {cidr: 169.254.169.254/32, ports: [80]}\n"
                                         "    - {cidr: 10.0.0.0/24, ports: [53], protocol: udp}\n"))
    assert [(str(r.network), sorted(r.ports), r.protocol) for r in config.network.allow.rules] == [
        ("169.254.169.254/32", [80], "tcp"), ("10.0.0.0/24", [53], "udp")]
    assert load_config(write(tmp_path, "network: {enabled: true}\n")).network.allow.rules == ()


@pytest.mark.parametrize("allow, message", [
    ("allow: {cidr: 10.0.0.1/32}", "3:10: network.allow: expected a list of at most 256 rules"),
    ("allow: [10.0.0.1/32]", "3:11: network.allow[0]: expected a mapping with cidr, ports and protocol"),
    ("allow: [{host: pypi.org, ports: [443]}]", "3:11: network.allow[0].cidr: missing; give a network like "
                                                "169.254.169.254/32\n{path}:3:12: network.allow[0].host: unknown key; "
                                                "a rule has cidr, ports and protocol (no host names here)"),
    ("allow: [{ports: [443]}]", "3:11: network.allow[0].cidr: missing"),
    ("allow: [{cidr: 10.0.0.1/24, ports: [443]}]", "3:18: network.allow[0].cidr: '10.0.0.1/24 has host bits set'"),
    ("allow: [{cidr: 10.0.0.0/24, ports: 443}]", "3:38: network.allow[0].ports: expected a list of 1 to 128 port"),
    ("allow: [{cidr: 10.0.0.0/24, ports: [0]}]", "3:39: network.allow[0].ports: '0' is not a port number"),
    ("allow: [{cidr: 10.0.0.0/24, ports: ['443']}]", "3:39: network.allow[0].ports: '443' is not a port number"),
    ("allow: [{cidr: 10.0.0.0/24, ports: [443], protocol: icmp}]", "3:55: network.allow[0].protocol: use tcp or udp"),
])
def test_bad_operator_allowances_name_the_rule(tmp_path: Path, allow: str, message: str) -> None:
    path = write(tmp_path, f"network:\n  enabled: true\n  {allow}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:" + message.replace("{path}", str(path)))


def test_operator_allowances_need_networking(tmp_path: Path) -> None:
    path = write(tmp_path, "network:\n  allow: [{cidr: 10.0.0.0/24, ports: [443]}]\n")
    assert problems(path) == [f"{path}:2:10: network.allow: has no effect while network.enabled is false; "
                              "enable networking or remove allow"]


def test_the_webhook_section_is_typed_when_the_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "webhook: {listen: '127.0.0.1:8471', secret_path: secret, "
                                         "github_config: gh/app.yml, max_body: 2MiB, labels: [a, b]}\n"))
    assert config.webhook == WebhookSettings(listen=("127.0.0.1", 8471), secret_path=tmp_path / "secret",
                                             github_config=tmp_path / "gh" / "app.yml", max_body=2 * 1024**2,
                                             labels=("a", "b"))  # paths relative to the config, like token_file
    [problem] = problems(write(tmp_path, "webhook: {listen: '127.0.0.1:99999', secret_path: s}\n"))
    assert "1:19: webhook.listen: expected HOST:PORT like 127.0.0.1:8470, not '127.0.0.1:99999'" in problem
    [problem] = problems(write(tmp_path, "webhook: {redeliver_every: 5}\n"))
    assert "1:28: webhook.redeliver_every: must be at least 30, not 5" in problem


def test_config_check_prints_ok_or_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yml"
    good.write_text("max_concurrent_jobs: 3\n")
    bad = tmp_path / "bad.yml"
    bad.write_text("max_concurrent_jobs: 0\nsockit: 1\n")
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"ok {good}"  # then what binds its runners' jobs
    assert main(["config", "check", str(bad), str(good)]) == 1
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if not line.startswith("  ")] == [f"ok {good}"]
    assert err.splitlines() == [f"{bad}:1:22: max_concurrent_jobs: must be at least 1, not 0",
                                f"{bad}:2:1: sockit: unknown setting (a typo?); did you mean 'socket'?"]


def test_config_schema_prints_the_published_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    assert capsys.readouterr().out == SCHEMA.read_text()
