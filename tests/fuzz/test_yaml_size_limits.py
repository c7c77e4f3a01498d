"""Oversized YAML documents are refused before they are composed (issue 17's fuzz findings: a 50,000-line
policy took 1.1-1.9 s to refuse, a 240 KB flow mapping about 1 s). The refusal is the assertion; the
time it took is printed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from policy import PolicyError, load_policy
from runner.service.config.reading import ConfigError, load_config

GOOD = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n"


def refused(text: str) -> str:
    started = time.perf_counter()
    with pytest.raises(PolicyError) as err:
        load_policy(text)
    print(f"refused {len(text)} bytes in {(time.perf_counter() - started) * 1000:.0f} ms")
    return str(err.value)


def test_a_policy_of_50000_lines_is_refused_for_its_lines() -> None:
    assert "50001 lines, more than 8192" in refused("version: 1\n" + "#\n" * 50000)


def test_a_flow_mapping_of_many_keys_is_refused_for_its_entries() -> None:
    flow = "{" + ", ".join(f"k{n}: {n}" for n in range(16000)) + "}"  # ~220 KB on one line
    assert "more than 1024 entries" in refused(f"version: 1\nx: {flow}\n")


def test_a_flow_list_of_many_items_is_refused_for_its_entries() -> None:
    assert "more than 1024 entries" in refused("version: 1\nallow: [" + "1, " * 60000 + "1]\n")


def test_many_small_mappings_are_refused_for_their_keys_in_all() -> None:
    rows = "".join(f"  - {{a{n}: 1, b: 2, c: 3, d: 4, e: 5}}\n" for n in range(1000))
    assert "more than 4096 keys in all" in refused("version: 1\nallow:\n" + rows)


def test_a_normal_policy_still_loads() -> None:
    assert load_policy(GOOD) is not None


def test_the_service_config_has_the_same_limits(tmp_path: Path) -> None:
    path = tmp_path / "config.yml"
    path.write_text("templates: [" + ", ".join("t" for _ in range(2000)) + "]\n")
    with pytest.raises(ConfigError, match="more than 1024 entries"):
        load_config(path)
