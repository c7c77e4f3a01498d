"""Fixtures for the GitHub integration tests; the fakes themselves are in github_fakes.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from runner.github.app import AppCredentials, GitHubApp, parse_timestamp
from runner.github.client import RetryPolicy
from tests.github.github_fakes import API, INSTALLATION_ID, TOKEN_OP, FakeClock, example, load_operations


@pytest.fixture(scope="session")
def operations() -> dict[str, Any]:
    return load_operations()


@pytest.fixture(scope="session")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="session")
def private_pem(rsa_key) -> str:
    return rsa_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


@pytest.fixture(scope="session")
def public_pem(rsa_key) -> str:
    return rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


@pytest.fixture
def clock(operations) -> FakeClock:
    """Starts one hour before the documented installation token example expires, so that token
    is fresh at the start of a test, as a just-minted token would be."""
    return FakeClock(parse_timestamp(example(operations, TOKEN_OP, "201")["expires_at"]) - 3600)


@pytest.fixture
def make_app(private_pem, clock) -> Callable[..., GitHubApp]:
    def make(**fields: Any) -> GitHubApp:
        fields.setdefault("client_id", "Iv1.8a61f9b3a7aba766")
        fields.setdefault("installation_id", INSTALLATION_ID)
        credentials = AppCredentials(private_key_pem=private_pem, **fields)
        return GitHubApp(credentials, retry=RetryPolicy(attempts=4), clock=clock, sleep=clock.sleep)

    return make


@pytest.fixture
def app(make_app) -> GitHubApp:
    return make_app()


@pytest.fixture
def token_endpoint(operations) -> Callable[..., Any]:
    """Registers the documented access-token answer on a `responses` mock."""

    def add(mock, installation_id: int = INSTALLATION_ID, body: dict | None = None):
        payload = body or example(operations, TOKEN_OP, "201")
        return mock.post(f"{API}/app/installations/{installation_id}/access_tokens", json=payload, status=201)

    return add
