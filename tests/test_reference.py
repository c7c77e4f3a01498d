"""The tests' reference material (tests/reference.py): a pinned, hash-checked test dependency that
scripts/setup --test installs from its lock, read back as the GitHub shapes the tests rely on; and what no
package has (the captured payloads) says in one line what is missing, skipping locally and failing in CI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

import tests.conftest
from tests import reference

MANIFEST = reference.ROOT / "requirements" / "reference" / "package.json"


def test_the_lock_pins_exactly_what_the_manifest_asks_for_each_with_its_hash() -> None:
    manifest, lock = json.loads(MANIFEST.read_text()), json.loads(reference.LOCK.read_text())
    wanted = manifest["dependencies"]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", version) for version in wanted.values()), f"not exact: {wanted}"
    assert lock["lockfileVersion"] == 3 and lock["packages"][""]["dependencies"] == wanted, \
        "requirements/reference/package-lock.json is stale: run npm install --package-lock-only there"
    for name, version in wanted.items():
        assert reference.locked_versions()[name] == version
    for key, entry in lock["packages"].items():
        if key:
            assert re.fullmatch(r"sha512-[A-Za-z0-9+/]{86}==", entry.get("integrity", "")), f"{key} has no sha512"
            assert "hasInstallScript" not in entry, f"{key} has an install script"


def test_setup_installs_the_lock_with_npm_ci_and_runs_no_package_script() -> None:
    setup = (reference.ROOT / "scripts" / "setup").read_text()
    code = "\n".join(line for line in setup.splitlines() if not line.lstrip().startswith("#"))
    assert "npm ci --ignore-scripts" in code and "npm install" not in code and "npm i " not in code
    stamp = re.search(r"reference_stamp=(.*?\))", code, re.S)
    assert stamp and "requirements/reference/package-lock.json" in stamp[1]  # a changed lock installs again
    assert re.search(r'if \[ "\$role" = test \] && ! command -v npm >/dev/null; then packages\+=\(npm\); fi', setup)
    assert ".reference/" in (reference.ROOT / ".gitignore").read_text().split()


def test_every_locked_package_is_installed_at_its_locked_version() -> None:
    for name in reference.locked_versions():
        assert (reference.package(name) / "package.json").is_file()


def test_a_package_at_another_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "@octokit" / "openapi"
    fake.mkdir(parents=True)
    (fake / "package.json").write_text('{"version": "1.0.0"}')
    monkeypatch.setattr(reference, "NODE_MODULES", tmp_path)
    with pytest.raises(RuntimeError, match="1.0.0 is installed, the lock says 23.0.2: scripts/setup --test"):
        reference.package("@octokit/openapi")
    with pytest.raises(RuntimeError, match="webhooks-examples is not installed: scripts/setup --test"):
        reference.package("@octokit/webhooks-examples")


@pytest.mark.parametrize("name", [name for names in reference.OCTOKIT_EXAMPLES.values() for name in names])
def test_each_octokit_example_is_the_one_its_name_says(name: str) -> None:
    stored = reference.stored(name)
    body = stored.json()
    action, _, rest = name.removesuffix(".payload.json").partition(".")
    assert body["action"] == action and set(body) >= {"repository", "sender"}
    assert ("organization" in body) == ("with-organization" in rest)
    assert ("deployment" in body) == ("with-deployment" in rest)
    if stored.event == "workflow_job":
        steps = [step["status"] for step in body["workflow_job"]["steps"]]
        assert ("queued" in steps) == ("with-queued-steps" in rest)
        assert body["workflow_job"]["conclusion"] == ({"success", "failure"} & set(rest.split(".")) or {None}).pop()


def test_the_derived_fragments_are_self_contained_and_their_examples_fit_them() -> None:
    """Every $ref of a fragment resolves inside it, and GitHub's own request example for generate-jitconfig
    passes the request schema the fleet's requests are checked against (so that check can pass at all)."""
    path = "/orgs/{org}/actions/runners/generate-jitconfig"
    document = reference.fragment("post", path)
    for kind, name in reference._refs(document):
        assert name in document["components"][kind], f"{kind}/{name} left out"
    operation = reference.operations()[f"POST {path}"]
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    for body in operation["request_examples"].values():
        jsonschema.validate(body, {**schema, "components": document["components"]})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x"}, {**schema, "components": document["components"]})
    created = operation["responses"]["201"]["examples"]["application/json:default"]
    assert set(created) >= {"runner", "encoded_jit_config"}
    assert reference.fragment_name("post", path) == "POST_orgs_org_actions_runners_generate-jitconfig.json"
    with pytest.raises(KeyError):
        reference.operations()["POST /no/such/operation"]


def test_the_action_schema_is_the_vendored_schemastore_one() -> None:
    schema = reference.action_schema()
    assert schema["$schema"].startswith("http://json-schema.org/") and "runs" in schema["required"]
    assert "jobs" in reference.workflow_schema()["required"]


@pytest.mark.parametrize("in_ci", [False, True])
def test_missing_captured_material_is_named_in_one_line_skipped_locally_and_failed_in_ci(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_ci: bool) -> None:
    monkeypatch.setattr(reference, "EXTERNAL", tmp_path / "shared" / "external")
    monkeypatch.setattr(tests.conftest, "IN_CI", in_ci)
    monkeypatch.setattr(reference, "IN_CI", in_ci)
    name = "listendev-lstn.pull_request.opened.from-fork.json"
    outcome = pytest.fail.Exception if in_ci else pytest.skip.Exception
    with pytest.raises(outcome) as raised:
        reference.captured(name)
    message = str(raised.value.msg)
    assert "\n" not in message and name in message and "shared/external/" in message and "listendev/lstn" in message
    assert not reference.stored(name).available
    if in_ci:
        with pytest.raises(outcome):
            reference.available_payloads()
    else:
        assert {stored.name for stored in reference.available_payloads()} == {
            name for names in reference.OCTOKIT_EXAMPLES.values() for name in names}
