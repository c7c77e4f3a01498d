"""Fuzz the service config loader: every input gives a config or a ConfigError whose every line names the
file (and, unless the whole file is at fault, its line and column); no other exception, no huge message."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from runner.service.config.reading import ConfigError, config_from_mapping, load_config
from runner.service.config.settings import ServiceConfig
from tests.fuzz.fuzzing import INPUTS, fuzz

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(tempfile.mkdtemp(prefix="mvc-fuzz-config-"))  # one file rewritten per input
atexit.register(shutil.rmtree, WORK, True)
MAX_MESSAGE = 16 * 1024  # 20 problems at most, each a line with a short quote of the file
WHOLE_FILE = ("is larger than", "cannot read the config", "more problems not shown", "YAML error:")


def docs_example() -> str:
    text = (ROOT / "docs" / "job-api.md").read_text()
    block = re.search(r"## Service config.*?```yaml\n(.*?)```", text, re.S).group(1)
    (WORK / "api-token").write_text("fuzz-token-0123456789abcdef\n")
    return block.replace("/etc/microvm-check/", f"{WORK}/")


SEEDS = [
    docs_example(),
    "state_dir: state\npolicy_dir: policies\nmax_concurrent_jobs: 4\n",
    "prewarm: {max_vms: 1, expire_seconds: 60}\nretention: {days: 3, max_records: 100}\nlogs: {max_bytes: 1MiB}\n",
    "network:\n  enabled: true\n  allow:\n    - {cidr: 169.254.169.254/32, ports: [80]}\n",
    "webhook: {listen: '127.0.0.1:8471', secret_path: secret, labels: [microvm], redeliver_every: 300}\n",
    "sandboxes: {group: users, repository: sandbox/sandbox}\nlocal_jobs: {repository: local/jobs}\n",
]
# What issue 13 found, and what YAML offers a hostile file: spliced into valid configs at random places.
SNIPPETS = [
    ".inf", "-.inf", ".nan", "1e999", "9" * 5000, "-1", "0x1f", "0o17", "1_000", "7:23", "~", "null", "yes",
    "&a [x, x]", "*a", "&a", "<<: *a", "!!python/object:os.system", "!!binary aGk=", "? [a]\n: b", "1: x",
    "\0", "\\0", '"\\0"', '"\\ud800"', "\x85", "\ufeff", "\t", "\r", "[" * 60, "{" * 60, "]", "}", "- ", ": ",
    "'", '"', "#", "%YAML 1.1\n---\n", "---\n", "...\n", "|\n  text", ">-\n  text", "{a: 1, a: 2}",
    "\xff", "é", "127.0.0.1:99999", "[::1]:80", "512MiB", "1T", "-5G", "../", "/..", "/.", "//",
]


@st.composite
def mutated_text(draw: st.DrawFn) -> bytes:
    text = draw(st.sampled_from(SEEDS)).encode()
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["splice", "delete", "byte", "duplicate", "indent"]))
        if action == "splice":
            text = text[:at] + draw(st.sampled_from(SNIPPETS)).encode("utf-8", "surrogatepass") + text[at:]
        elif action == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 40)):]
        elif action == "byte":
            text = text[:at] + bytes([draw(st.integers(0, 255))]) + text[at + 1:]
        elif action == "duplicate":
            line_end = text.find(b"\n", at)
            line_start = text.rfind(b"\n", 0, at) + 1
            text = text[:line_end + 1] + text[line_start:line_end + 1] + text[line_end + 1:]
        else:
            text = text[:at] + b" " * draw(st.integers(1, 6)) + text[at:]
    return text


def check_error(err: ConfigError, source: str) -> None:
    message = str(err)
    assert len(message) <= MAX_MESSAGE, f"a {len(message)}-character message"
    for line in message.splitlines():
        located = re.match(re.escape(source) + r":[1-9][0-9]*:[1-9][0-9]*: ", line)
        assert located or (line.startswith(f"{source}: ") and any(w in line for w in WHOLE_FILE)), line


@fuzz(800)
@given(mutated_text())
def test_mutated_config_files(text: bytes) -> None:
    INPUTS["config-file"] += 1
    path = WORK / "service.yml"
    path.write_bytes(text)
    try:
        config = load_config(path)
    except ConfigError as err:
        check_error(err, str(path))
    else:
        assert isinstance(config, ServiceConfig)


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["512MiB", "1G", "127.0.0.1:8470", "mvc", "eth0", "base", "10.0.0.0/8"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)
TOP_KEYS = [f.name for f in fields(ServiceConfig)] + ["token_file", "unknown_key"]


def section_of(values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Mostly the real keys of a section, so the values reach the readers behind them."""
    known = ["vcpus", "memory_mib", "max_count", "max_total_bytes", "max_bytes", "max_entry_bytes", "days",
             "max_records", "max_vms", "expire_seconds", "enabled", "uplink_interface", "slot_prefix", "slots",
             "allow", "listen", "secret_path", "labels", "max_body", "redeliver_every", "github_config"]
    return st.dictionaries(st.sampled_from(known), values, max_size=5)


RULES = st.lists(st.fixed_dictionaries({"cidr": st.one_of(st.sampled_from(["10.0.0.0/8", "10.0.0.1/8", "::/0"]),
                                                           SCALARS),
                                        "ports": st.one_of(st.lists(st.integers(-5, 70000), max_size=3), SCALARS)},
                                       optional={"protocol": st.sampled_from(["tcp", "udp", "icmp"])}), max_size=3)


@fuzz(150)
@given(st.dictionaries(st.sampled_from(TOP_KEYS),
                       st.one_of(VALUES, section_of(st.one_of(VALUES, RULES))), max_size=8))
def test_config_values_as_file_and_as_mapping(data: dict[str, Any]) -> None:
    """The same values through `config_from_mapping` and through a YAML file: the same verdict."""
    INPUTS["config-values"] += 2
    path = WORK / "values.yml"
    path.write_text(yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), allow_unicode=True))
    verdicts = []
    for load, source in ((lambda: config_from_mapping(data, where="<values>", base=WORK), "<values>"),
                         (lambda: load_config(path), str(path))):
        try:
            verdicts.append(load())
        except ConfigError as err:
            if source == "<values>":  # no lines in Python values: every problem names the source
                assert len(str(err)) <= MAX_MESSAGE and all(
                    line.startswith("<values>: ") for line in str(err).splitlines())
            else:
                check_error(err, source)
            verdicts.append("error")
    assert (verdicts[0] == "error") == (verdicts[1] == "error"), verdicts
