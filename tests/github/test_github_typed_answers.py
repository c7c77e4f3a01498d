"""GitHub answers whose JSON is not the object the endpoint documents are refused with a GitHubError."""

from __future__ import annotations

import pytest
import responses

from runner.github.client import GitHubClient
from runner.github.errors import GitHubError
from runner.github.runners import RunnerAdmin
from tests.github.github_fakes import API

ORG = "octo-org"


def test_a_registration_token_answer_that_is_not_an_object_is_refused() -> None:
    admin = RunnerAdmin(GitHubClient(lambda: "ghs_token", sleep=lambda _: None), ORG)
    with responses.RequestsMock() as mock:
        mock.post(f"{API}/orgs/{ORG}/actions/runners/registration-token", json=["token"], status=201)
        with pytest.raises(GitHubError, match="registration-token with JSON that is not an object"):
            admin.registration_token()
