"""Fakes of GitHub built from GitHub's own shapes (tests/reference.py says where each comes from).

The example bodies come from GitHub's own OpenAPI description (@octokit/openapi) and the request bodies our
code sends are validated against the request schemas of the same operations, so these tests fail if our
shapes drift from GitHub's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema

from tests import reference
from tests.reference import Payload

API = "https://api.github.com"
INSTALLATION_ID = 3456996  # the installation in octokit's workflow_job examples
TOKEN_OP = "POST /app/installations/{installation_id}/access_tokens"
CONTENTS_OP = "GET /repos/{owner}/{repo}/contents/{path}"
CONTENTS_FILE = "application/json:response-if-content-is-a-file"


def load_operations() -> reference.Operations:
    return reference.operations()


def example(operations: dict[str, Any], operation: str, status: str, name: str | None = None) -> Any:
    """A deep copy of one documented example response body."""
    examples = operations[operation]["responses"][status]["examples"]
    key = name or next(iter(examples))
    return copy.deepcopy(examples[key])


def request_schema(fragment: str, path: str, method: str) -> dict[str, Any]:
    """The documented request body schema, with the fragment's components so `$ref`s resolve."""
    assert fragment == reference.fragment_name(method, path), f"{fragment} is not {method.upper()} {path}"
    document = reference.fragment(method, path)
    body = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return {**body, "components": document["components"]}


# The schema's formats are checked too (date-time needs rfc3339-validator, a test dependency): without a
# checker jsonschema takes `"started_at": ""` as a valid date-time, and GitHub answers it with 422.
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
assert "date-time" in FORMATS.checkers, "jsonschema cannot check date-time here: install rfc3339-validator"


def assert_valid_request(body: bytes | str | None, fragment: str, path: str, method: str) -> dict[str, Any]:
    parsed = json.loads(body) if body else {}
    jsonschema.validate(parsed, request_schema(fragment, path, method), format_checker=FORMATS)
    return parsed


class FakeClock:
    """Time that moves only when a test (or a retry's sleep) moves it."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def webhook_payloads() -> list[Payload]:
    """Every stored payload: octokit's examples and the captured ones (incl. octokit's deleted `started`)."""
    return reference.webhook_payloads()


def event_name(payload: Payload) -> str:
    """The `X-GitHub-Event` a stored payload was delivered with."""
    return payload.event


def load_payload(name: str) -> dict[str, Any]:
    """The stored payload whose name starts with `name`; a captured one skips the test where it is missing
    (see tests/reference.py)."""
    return reference.payload(name)


def run_cli(argv: list[str]) -> int:
    """`microvm-check ARGS` with only this area's commands, as `runner.cli.main` runs them, so these
    tests do not depend on other areas importing cleanly."""
    import argparse

    from runner.cli import run_command
    from runner.commands import github as cli

    parser = argparse.ArgumentParser(prog="microvm-check")
    cli.register(parser.add_subparsers(dest="command"))
    return run_command(parser.parse_args(argv))
