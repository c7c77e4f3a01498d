"""Retries, rate limits and the errors a user can act on."""

from __future__ import annotations

import pytest
import requests
import responses

from runner.github.client import GitHubClient, RetryPolicy
from runner.github.errors import (
    Forbidden,
    GitHubError,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from tests.github.github_fakes import API, FakeClock

RUNNERS = f"{API}/orgs/octo-org/actions/runners"
OK = {"total_count": 0, "runners": []}


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock(1_700_000_000.0)


@pytest.fixture
def client(fake_clock) -> GitHubClient:
    return GitHubClient(
        lambda: "ghs_token", retry=RetryPolicy(attempts=4, base_delay=1.0, max_wait=60.0),
        clock=fake_clock, sleep=fake_clock.sleep,
    )


@responses.activate
def test_5xx_is_retried_with_backoff(client, fake_clock) -> None:
    responses.get(RUNNERS, status=502)
    responses.get(RUNNERS, status=503)
    responses.get(RUNNERS, json=OK)
    assert client.get("/orgs/octo-org/actions/runners") == OK
    assert fake_clock.sleeps == [1.0, 2.0]


@responses.activate
def test_5xx_gives_up_after_the_attempts(client, fake_clock) -> None:
    responses.get(RUNNERS, status=500)
    with pytest.raises(Unavailable, match="after 4 attempts"):
        client.get("/orgs/octo-org/actions/runners")
    assert len(responses.calls) == 4
    assert fake_clock.sleeps == [1.0, 2.0, 4.0]


@responses.activate
def test_429_honours_retry_after(client, fake_clock) -> None:
    responses.get(RUNNERS, status=429, headers={"Retry-After": "7"}, json={"message": "secondary rate limit"})
    responses.get(RUNNERS, json=OK)
    assert client.get("/orgs/octo-org/actions/runners") == OK
    assert fake_clock.sleeps == [7.0]


@responses.activate
def test_403_primary_limit_waits_for_the_reset(client, fake_clock) -> None:
    reset = int(fake_clock.now) + 30
    headers = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(reset)}
    responses.get(RUNNERS, status=403, headers=headers, json={"message": "API rate limit exceeded"})
    responses.get(RUNNERS, json=OK)
    assert client.get("/orgs/octo-org/actions/runners") == OK
    assert fake_clock.sleeps == [31.0]
    assert fake_clock.now >= reset


@responses.activate
def test_403_secondary_limit_without_headers_backs_off(client, fake_clock) -> None:
    message = {"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}
    responses.get(RUNNERS, status=403, json=message)
    responses.get(RUNNERS, json=OK)
    assert client.get("/orgs/octo-org/actions/runners") == OK
    assert fake_clock.sleeps == [1.0]


@responses.activate
def test_a_reset_beyond_the_bound_is_not_waited_for(client, fake_clock) -> None:
    headers = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(fake_clock.now) + 3000)}
    responses.get(RUNNERS, status=403, headers=headers, json={"message": "API rate limit exceeded"})
    with pytest.raises(RateLimited, match="try again later"):
        client.get("/orgs/octo-org/actions/runners")
    assert fake_clock.sleeps == []
    assert len(responses.calls) == 1


@responses.activate
def test_rate_limit_that_persists_is_reported(client, fake_clock) -> None:
    responses.get(RUNNERS, status=429, headers={"Retry-After": "1"})
    with pytest.raises(RateLimited, match="still exceeded"):
        client.get("/orgs/octo-org/actions/runners")
    assert len(responses.calls) == 4


@pytest.mark.parametrize(
    ("status", "error", "hint"),
    [
        (401, Unauthorized, "private key"),
        (403, Forbidden, "permissions"),
        (404, NotFound, "installed"),
        (422, ValidationFailed, "invalid"),
    ],
)
@responses.activate
def test_client_errors_are_not_retried_and_explain(client, fake_clock, status, error, hint) -> None:
    body = {"message": "Resource not accessible by integration", "documentation_url": "https://docs.github.com"}
    responses.get(RUNNERS, status=status, json=body)
    with pytest.raises(error, match=f"^GitHub {status} for GET /orgs/octo-org/actions/runners: Resource not accessible by integration ") as err:
        client.get("/orgs/octo-org/actions/runners")
    assert len(responses.calls) == 1
    assert fake_clock.sleeps == []
    text = str(err.value)
    assert f"GitHub {status} for GET /orgs/octo-org/actions/runners" in text
    assert "Resource not accessible by integration" in text and hint in text
    assert err.value.status == status


@responses.activate
def test_connection_errors_are_retried_then_explained(client, fake_clock) -> None:
    responses.get(RUNNERS, body=requests.ConnectionError("refused"))
    with pytest.raises(Unavailable, match="could not be reached"):
        client.get("/orgs/octo-org/actions/runners")
    assert len(responses.calls) == 4


@responses.activate
def test_pagination_follows_link_next(client, operations) -> None:
    from tests.github.github_fakes import example

    page1 = example(operations, "GET /orgs/{org}/actions/runners", "200")
    page2 = {"total_count": 3, "runners": [dict(page1["runners"][0], id=99, name="third")]}
    link = f'<{RUNNERS}?page=2>; rel="next", <{RUNNERS}?page=2>; rel="last"'
    responses.get(RUNNERS, json=page1, headers={"Link": link})
    responses.get(f"{RUNNERS}?page=2", json=page2)
    ids = [runner["id"] for runner in client.paginate("/orgs/octo-org/actions/runners", "runners")]
    assert ids == [23, 24, 99]
    assert responses.calls[0].request.params == {"per_page": "100"}


@pytest.mark.parametrize("link", ["https://evil.example/steal", "https://api.github.com.evil.example/x",
                                  "http://api.github.com/orgs/octo-org/actions/runners"])
@responses.activate
def test_pagination_never_follows_links_off_the_api(client, link) -> None:
    responses.get(RUNNERS, json=OK, headers={"Link": f'<{link}>; rel="next"'})
    assert list(client.paginate("/orgs/octo-org/actions/runners", "runners")) == []
    assert len(responses.calls) == 1


def test_the_token_is_never_sent_off_the_api(client) -> None:
    with pytest.raises(GitHubError, match="refusing to send the GitHub token"):
        client.request("GET", "https://api.github.com.evil.example/x")


@responses.activate
def test_a_non_json_answer_is_explained(client) -> None:
    responses.get(RUNNERS, body="<html>proxy login</html>")
    with pytest.raises(GitHubError, match="not JSON"):
        client.get("/orgs/octo-org/actions/runners")
