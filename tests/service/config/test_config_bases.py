"""The service config's `bases:` section: the warm bases' disk budget and setup timeout, typed, one default."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from runner.errors import ConfigError
from runner.service.config.reading import load_config
from runner.service.config.schema import schema_text
from runner.service.config.settings import GIB, MIB, Bases, ServiceConfig
from runner.service.jobs.bases import BaseSettings


def test_the_bases_section_reaches_the_bases_settings(tmp_path: Path) -> None:
    path = tmp_path / "service.yml"
    path.write_text("templates: [base, big]\ncheckout_max_bytes: 64MiB\n"
                    "bases: {disk_budget: 1.5GiB, setup_timeout_seconds: 600}\n")
    settings = BaseSettings.from_config(load_config(path))
    assert settings == BaseSettings(parent="base", budget_bytes=3 * GIB // 2, setup_timeout_s=600.0,
                                    max_checkout_bytes=64 * MIB)


def test_its_defaults_are_declared_once() -> None:
    settings = BaseSettings.from_config(ServiceConfig())
    assert (settings.budget_bytes, settings.setup_timeout_s) == (Bases().disk_budget, Bases().setup_timeout_seconds)
    published = json.loads(schema_text())["properties"]["bases"]["properties"]
    assert published["disk_budget"]["default"] == Bases().disk_budget == 20 * GIB


@pytest.mark.parametrize("text, message", [
    ("bases: {disk_budget: lots}", "bases.disk_budget: expected a size"),
    ("bases: {setup_timeout_seconds: 0}", "bases.setup_timeout_seconds: must be at least 1, not 0"),
    ("bases: {disk_budgte: 1GiB}", "bases.disk_budgte: unknown setting (a typo?); did you mean 'disk_budget'?"),
])
def test_the_loader_and_the_schema_refuse_a_bad_one(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "service.yml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        load_config(path)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(text), json.loads(schema_text()))
