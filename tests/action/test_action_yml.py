"""action.yml against SchemaStore's github-action schema (as check-jsonschema vendors it), and the wiring of its
inputs."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.reference import action_schema

ROOT = Path(__file__).resolve().parents[2]

ACTION = ROOT / "action.yml"


@pytest.fixture
def schema() -> dict:
    return action_schema()


@pytest.fixture
def metadata() -> dict:
    return yaml.safe_load(ACTION.read_text())


def test_action_yml_validates_against_schemastore(schema: dict, metadata: dict) -> None:
    jsonschema.validate(metadata, schema)


def test_schema_rejects_a_non_string_default(schema: dict, metadata: dict) -> None:
    # Proves the validation above has teeth: the schema wants string defaults.
    metadata["inputs"]["include-git"]["default"] = False
    with pytest.raises(jsonschema.ValidationError, match="^False is not of type 'string'"):
        jsonschema.validate(metadata, schema)


def test_every_input_reaches_the_step_as_an_env_var_and_never_the_script(metadata: dict) -> None:
    step = metadata["runs"]["steps"][0]
    for name in metadata["inputs"]:
        env_name = "INPUT_" + name.upper().replace("-", "_")
        assert step["env"][env_name] == "${{ inputs.%s }}" % name
    assert "${{" not in step["run"], "inputs pasted into a script become shell code"
    assert re.search(r"exec \"\$python\" -I -m action$", step["run"], re.M)


def test_outputs_come_from_the_step(metadata: dict) -> None:
    step_id = metadata["runs"]["steps"][0]["id"]
    assert set(metadata["outputs"]) == {"exit-code", "junit-passed", "junit-failed", "result-json",
                                        "attestation"}
    for name, spec in metadata["outputs"].items():
        assert spec["value"] == "${{ steps.%s.outputs.%s }}" % (step_id, name)
