"""X-Hub-Signature-256 against the vector and near misses in GitHub's docs (shared/external/docs/*facts.md:
no package has them, so the tests that quote them say so where it is missing; tests/reference.py)."""

from __future__ import annotations

import re

import pytest

from runner.github.signature import sign, verify
from tests.reference import captured_path

SECRET = b"It's a Secret to Everybody"
PAYLOAD = b"Hello, World!"


def documented(label: str) -> str:
    """A value quoted in the facts file, so the test uses the docs' text and not a copy of it."""
    facts = captured_path("webhook-signature-and-app-jwt-facts.md").read_text()
    match = re.search(re.escape(label) + r"[^\n]*?((?:sha1=|sha256=)?[0-9a-f]{40,64})", facts)
    assert match, label
    return match.group(1)


def test_documented_vector_passes() -> None:
    header = documented("* X-Hub-Signature-256:")
    assert header == "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert sign(SECRET, PAYLOAD) == header
    assert verify(SECRET, PAYLOAD, header)


def test_curly_apostrophe_secret_is_a_different_key() -> None:
    curly = "It\u2019s a Secret to Everybody".encode()
    assert sign(curly, PAYLOAD) == "sha256=" + documented("curly apostrophe U+2019 in secret ->")
    assert not verify(curly, PAYLOAD, documented("* X-Hub-Signature-256:"))


def test_trailing_newline_changes_the_digest() -> None:
    header = documented("* X-Hub-Signature-256:")
    assert sign(SECRET, PAYLOAD + b"\n") == "sha256=" + documented('payload with trailing "\\n"        ->')
    assert not verify(SECRET, PAYLOAD + b"\n", header)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",  # no sha256= prefix
        "sha256=757107EA0EB2509FC211221CCE984B8A37570B6D7586C22C46F4379C8B043E17",  # hex case differs
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e1",  # truncated
        "sha256=6dcb09b5b57875f334f61aebed695e2e4193db5e",  # the OpenAPI placeholder
        "sha1=01dc10d0c83e72ed246219cdd91669667fe2ca59",  # the legacy header's value
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17\u00e9",
    ],
)
def test_near_misses_fail(header: str | None) -> None:
    assert not verify(SECRET, PAYLOAD, header)


def test_empty_secret_never_verifies() -> None:
    assert not verify(b"", PAYLOAD, sign(b"", PAYLOAD))
