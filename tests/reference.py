"""The tests' reference material: GitHub's own shapes, and the one place that knows where each comes from.

Installed with the tests (`scripts/setup --test`), pinned and hash-checked, so a clone runs them:
- octokit's webhook examples: the npm package @octokit/webhooks-examples (requirements/reference/, installed
  into .reference/), under the file names octokit's repository gives them (`queued.payload.json`, ...);
- GitHub's REST description: @octokit/openapi's `api.github.com` document, from which `operations()` derives
  each operation's parameters and example responses, and `fragment()` an operation with every component it
  references (so a request schema's `$ref`s resolve);
- SchemaStore's GitHub action and workflow schemas, as check-jsonschema (a test dependency) vendors them.

What no package has stays optional: payloads captured from real deliveries in public repositories, octokit's
deleted `started` example and the webhook-signature facts, kept in `shared/external/` beside the checkout
(its README says where each comes from). `captured()` and `captured_path()` give one; where it is missing the
test skips with one line that names it and where it comes from, and fails under CI=true (tests/conftest.py
`require`).
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "reference" / "package-lock.json"
NODE_MODULES = ROOT / ".reference" / "node_modules"
EXTERNAL = ROOT.parent / "shared" / "external"  # the optional, captured material (see the docstring)
SETUP = "scripts/setup --test installs it (npm ci of requirements/reference/package-lock.json into .reference/)"

# octokit's examples by the names of their files in octokit's repository (payload-examples/api.github.com/),
# at their place in the package's index (tests/test_reference.py checks that each is the one its name says)
OCTOKIT_EXAMPLES = {
    "workflow_job": {
        "completed.failure.with-organization.payload.json": 1,
        "completed.success.with-organization.payload.json": 2,
        "in_progress.payload.json": 3,
        "in_progress.with-queued-steps.payload.json": 4,
        "queued.payload.json": 5,
        "queued.with-deployment.payload.json": 6,
        "waiting.payload.json": 7,
    },
    "pull_request": {
        "closed.payload.json": 3,
        "opened.payload.json": 12,
        "opened.with-organization.payload.json": 14,
        "reopened.payload.json": 18,
        "synchronize.payload.json": 22,
    },
}
# What no package has, under shared/external/: (event, path, where it comes from)
CAPTURED = {
    "started.with-organization.payload.json.DELETED-historical": (
        "workflow_job", "webhooks/octokit-webhooks-payload-examples/workflow_job/",
        "octokit's example of the `started` action GitHub no longer sends, deleted from octokit's repository"),
    "github-aws-runners.check_run.json": (
        "check_run", "webhooks/real-captured/", "a real delivery, from github-aws-runners' test resources"),
    "github-aws-runners.workflow_job.queued.self-hosted.json": (
        "workflow_job", "webhooks/real-captured/", "a real delivery, from github-aws-runners' test resources"),
    "listendev-lstn.pull_request.opened.from-fork.json": (
        "pull_request", "webhooks/real-captured/", "a real fork pull request, from listendev/lstn's test data"),
    "listendev-lstn.pull_request.opened.same-repo.reviewdog.json": (
        "pull_request", "webhooks/real-captured/", "a real pull request, from listendev/lstn's test data"),
    "tarantool-job-rerunner@a5e5a579.workflow_job.completed.failure.runner-tntmac06.json": (
        "workflow_job", "webhooks/real-captured/", "a real delivery, from tarantool/job-rerunner's README"),
    "tarantool-job-rerunner@head.workflow_job.in_progress.in_progress.runner-ghacts-shared-1-2-n1.json": (
        "workflow_job", "webhooks/real-captured/", "a real delivery, from tarantool/job-rerunner's README"),
    "webhook-signature-and-app-jwt-facts.md": (
        "", "docs/", "GitHub's documented X-Hub-Signature-256 test vector and near misses"),
}


IN_CI = os.environ.get("CI", "").lower() == "true"


def _require(present: bool, why: str) -> None:
    from tests.conftest import require  # here, not at the top: conftest's own imports stay first

    require(present, why)


# -- the npm packages ------------------------------------------------------------------------------------------

@cache
def locked_versions() -> dict[str, str]:
    """{package: version} of every package in requirements/reference/package-lock.json."""
    packages = json.loads(LOCK.read_text())["packages"]
    return {key.removeprefix("node_modules/"): entry["version"] for key, entry in packages.items() if key}


def package(name: str) -> Path:
    """The installed package's directory, at the locked version (else an error saying how to install it)."""
    directory = NODE_MODULES / name
    manifest = directory / "package.json"
    if not manifest.is_file():
        raise RuntimeError(f"the tests' reference material {name} is not installed: {SETUP}")
    installed, locked = json.loads(manifest.read_text())["version"], locked_versions()[name]
    if installed != locked:
        raise RuntimeError(f"{name} {installed} is installed, the lock says {locked}: {SETUP}")
    return directory


# -- webhook payloads --------------------------------------------------------------------------------------------

@cache
def _octokit_index() -> dict[str, list[dict[str, Any]]]:
    index = json.loads((package("@octokit/webhooks-examples") / "api.github.com" / "index.json").read_text())
    return {entry["name"]: entry["examples"] for entry in index}


@dataclass(frozen=True)
class Payload:
    """One stored webhook payload: an octokit example (always there) or a captured one (optional)."""

    name: str
    event: str  # the X-GitHub-Event it is delivered with

    @property
    def captured(self) -> bool:
        return self.name in CAPTURED

    @property
    def available(self) -> bool:
        """An octokit example always is; a captured payload where shared/external/ holds it."""
        return not self.captured or (EXTERNAL / CAPTURED[self.name][1] / self.name).is_file()

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_bytes(self) -> bytes:
        if self.captured:
            return captured_path(self.name).read_bytes()
        return json.dumps(_octokit_index()[self.event][OCTOKIT_EXAMPLES[self.event][self.name]]).encode()

    def json(self) -> Any:
        return json.loads(self.read_bytes())


def webhook_payloads() -> list[Payload]:
    """Every stored payload: octokit's examples, then the captured ones (each skips where it is missing)."""
    examples = [Payload(name, event) for event, names in OCTOKIT_EXAMPLES.items() for name in sorted(names)]
    captures = [Payload(name, event) for name, (event, _, _) in sorted(CAPTURED.items()) if event]
    return examples + captures


def available_payloads() -> list[Payload]:
    """The stored payloads there are, for a test that is seeded with as many as it finds (a fuzzer): every
    octokit example and each captured payload that is present; under CI=true a missing one fails."""
    found = []
    for stored in webhook_payloads():
        if stored.available:
            found.append(stored)
        elif IN_CI:
            captured_path(stored.name)  # fails, naming it
    return found


def stored(name: str) -> Payload:
    """The stored payload named `name` (read only when used: a captured one skips there if it is missing)."""
    found = [candidate for candidate in webhook_payloads() if candidate.name == name]
    assert found, f"no stored payload is named {name}"
    return found[0]


def payload(name: str) -> Any:
    """The stored payload whose name starts with `name`, parsed (a fresh copy)."""
    matches = [stored for stored in webhook_payloads() if stored.name.startswith(name)]
    assert len(matches) == 1, f"{name} matches {[stored.name for stored in matches]}"
    return matches[0].json()


def captured_path(name: str) -> Path:
    """The captured file `name` under shared/external/; where it is missing the test says so and skips (or
    fails under CI=true)."""
    _, folder, what = CAPTURED[name]
    path = EXTERNAL / folder / name
    _require(path.is_file(), f"needs {name} ({what}): no package has it; put shared/external/ "
                             f"(see its README) beside the checkout")
    return path


def captured(name: str) -> Any:
    """A captured payload, parsed: see `captured_path`."""
    return json.loads(captured_path(name).read_text())


# -- GitHub's REST description -------------------------------------------------------------------------------------

@cache
def _rest_description() -> dict[str, Any]:
    return json.loads((package("@octokit/openapi") / "generated" / "api.github.com.json").read_text())


def _without_octokit(value: Any) -> Any:
    """The description as GitHub publishes it: octokit's own `x-octokit` extension left out."""
    if isinstance(value, dict):
        return {key: _without_octokit(item) for key, item in value.items() if key != "x-octokit"}
    if isinstance(value, list):
        return [_without_octokit(item) for item in value]
    return value


def _resolve(value: Any) -> Any:
    """One `$ref` into the components followed (an example, parameter or header is one level deep)."""
    while isinstance(value, dict) and "$ref" in value:
        kind, name = value["$ref"].removeprefix("#/components/").split("/")
        value = _rest_description()["components"][kind][name]
    return value


def _refs(value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        if isinstance(value.get("$ref"), str) and value["$ref"].startswith("#/components/"):
            kind, name = value["$ref"].removeprefix("#/components/").split("/")
            yield kind, name
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def fragment(method: str, path: str) -> dict[str, Any]:
    """A self-contained OpenAPI document of one operation: the operation and every component it references,
    transitively, so that a schema taken from it with `components` beside it resolves."""
    description = _rest_description()
    operation = _without_octokit(description["paths"][path][method.lower()])
    components: dict[str, dict[str, Any]] = {}
    pending = list(_refs(operation))
    while pending:
        kind, name = pending.pop()
        if name in components.get(kind, {}):
            continue
        item = _without_octokit(description["components"][kind][name])
        components.setdefault(kind, {})[name] = item
        pending.extend(_refs(item))
    return {
        "openapi": description["openapi"],
        "info": {"title": "Fragment of GitHub REST API description (api.github.com)",
                 "version": description["info"]["version"], "x-source": "@octokit/openapi generated/api.github.com.json"},
        "paths": {path: {method.lower(): operation}},
        "components": {kind: dict(sorted(items.items())) for kind, items in sorted(components.items())},
    }


def fragment_name(method: str, path: str) -> str:
    """The file name a fragment had in shared/external/rest-api/ (`POST_repos_owner_repo_check-runs.json`)."""
    return method.upper() + re.sub(r"[{}]", "", path).replace("/", "_") + ".json"


def _operation(method: str, path: str) -> dict[str, Any]:
    """One operation flattened: parameters, request examples, and per status the headers and example bodies
    (keyed `<media type>:<example name>`)."""
    operation = _rest_description()["paths"][path][method.lower()]

    def examples(content: Mapping[str, Any]) -> dict[str, Any]:
        return {f"{media}:{name}": copy.deepcopy(_resolve(example)["value"])
                for media, body in content.items() for name, example in body.get("examples", {}).items()}

    parameters = [_resolve(parameter) for parameter in operation.get("parameters", [])]
    responses = {}
    for status, response in operation["responses"].items():
        response = _resolve(response)
        responses[status] = {
            "description": response.get("description"),
            "headers": {name: copy.deepcopy(_resolve(header).get("schema")) for name, header
                        in response.get("headers", {}).items()},
            "examples": examples(response.get("content", {})),
        }
    return {
        "method": method.upper(), "path": path, "operationId": operation["operationId"],
        "docs": operation.get("externalDocs", {}).get("url"),
        "parameters": [{"name": p["name"], "in": p["in"], "required": p.get("required"),
                        "schema": copy.deepcopy(p.get("schema"))} for p in parameters],
        "request_examples": examples(operation.get("requestBody", {}).get("content", {})),
        "responses": responses,
    }


class Operations(Mapping[str, dict[str, Any]]):
    """GitHub's REST operations keyed `METHOD /path` (`POST /repos/{owner}/{repo}/check-runs`), each flattened
    as `_operation` says, derived on first use; a fresh copy per `operations()` call, so a test may change it."""

    def __init__(self) -> None:
        self._derived: dict[str, dict[str, Any]] = {}

    def __getitem__(self, key: str) -> dict[str, Any]:
        if key not in self._derived:
            method, _, path = key.partition(" ")
            if method.lower() not in _rest_description()["paths"].get(path, {}):
                raise KeyError(key)
            self._derived[key] = _operation(method, path)
        return self._derived[key]

    def __iter__(self) -> Iterator[str]:
        for path, item in _rest_description()["paths"].items():
            for method in item:
                if method in ("get", "put", "post", "delete", "patch", "head", "options"):
                    yield f"{method.upper()} {path}"

    def __len__(self) -> int:
        return sum(1 for _ in self)


def operations() -> Operations:
    return Operations()


# -- GitHub Actions' schemas ---------------------------------------------------------------------------------------

def _vendored(name: str) -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / name).read_text(encoding="utf-8"))


def action_schema() -> dict[str, Any]:
    """SchemaStore's schema of an action's metadata (action.yml), as check-jsonschema vendors it."""
    return _vendored("github-actions.json")


def workflow_schema() -> dict[str, Any]:
    """SchemaStore's schema of a workflow file, as check-jsonschema vendors it."""
    return _vendored("github-workflows.json")
