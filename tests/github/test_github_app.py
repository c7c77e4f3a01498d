"""App JWT claims and the installation token cache."""

from __future__ import annotations

import jwt
import pytest
import responses

from runner.github.errors import GitHubError, NotFound, Unauthorized
from tests.github.github_fakes import API, INSTALLATION_ID, TOKEN_OP, example


def decode(token: str, public_pem: str, clock) -> dict:
    return jwt.decode(token, public_pem, algorithms=["RS256"], options={"verify_exp": False, "verify_iat": False})


def test_jwt_claims_follow_githubs_rules(app, public_pem, clock) -> None:
    token = app.jwt()
    claims = decode(token, public_pem, clock)
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    assert claims["iat"] == int(clock.now) - 60
    assert 0 < claims["exp"] - clock.now <= 600
    assert claims["iss"] == "Iv1.8a61f9b3a7aba766"


def test_jwt_issuer_is_the_app_id_without_a_client_id(make_app, public_pem, clock) -> None:
    app = make_app(client_id=None, app_id=12345)
    assert decode(app.jwt(), public_pem, clock)["iss"] == "12345"


def test_jwt_without_any_id_is_a_user_error(make_app) -> None:
    with pytest.raises(GitHubError, match="client_id or an app_id"):
        make_app(client_id=None).jwt()


def test_jwt_with_a_broken_key_says_what_to_do(private_pem, clock) -> None:
    from runner.github.app import AppCredentials, GitHubApp

    app = GitHubApp(AppCredentials(private_key_pem="not a key", app_id=1), clock=clock, sleep=clock.sleep)
    with pytest.raises(GitHubError, match="private key"):
        app.jwt()


@responses.activate
def test_token_request_is_authenticated_with_the_jwt(app, public_pem, clock, token_endpoint, operations) -> None:
    token_endpoint(responses)
    assert app.installation_token() == example(operations, TOKEN_OP, "201")["token"]
    request = responses.calls[0].request
    assert request.headers["Authorization"].startswith("Bearer ")
    assert request.headers["X-GitHub-Api-Version"] == "2022-11-28"
    claims = decode(request.headers["Authorization"].removeprefix("Bearer "), public_pem, clock)
    assert claims["iss"] == "Iv1.8a61f9b3a7aba766"


@responses.activate
def test_token_is_cached_until_shortly_before_expiry(app, clock, token_endpoint, operations) -> None:
    endpoint = token_endpoint(responses)
    app.installation_token()
    clock.now += 3600 - 400  # 400 s left: still reused
    app.installation_token()
    assert endpoint.call_count == 1
    clock.now += 150  # 250 s left: inside the refresh margin
    app.installation_token()
    assert endpoint.call_count == 2


BAD_CREDENTIALS = (r"^GitHub 401 for GET /orgs/octo-org/actions/runners: Bad credentials \(check the App ID/client ID, "
                   r"the private key and this host's clock\)$")


@responses.activate
def test_token_is_used_for_installation_calls_and_dropped_after_401(app, token_endpoint, operations) -> None:
    endpoint = token_endpoint(responses)
    token = example(operations, TOKEN_OP, "201")["token"]
    responses.get(f"{API}/orgs/octo-org/actions/runners", json={"message": "Bad credentials"}, status=401)
    with pytest.raises(Unauthorized, match=BAD_CREDENTIALS):
        app.as_installation.get("/orgs/octo-org/actions/runners")
    assert responses.calls[1].request.headers["Authorization"] == f"Bearer {token}"
    assert len(responses.calls) == 2  # the 401 was not retried
    with pytest.raises(Unauthorized, match=BAD_CREDENTIALS):
        app.as_installation.get("/orgs/octo-org/actions/runners")
    assert endpoint.call_count == 2  # but the next call minted a new token


@responses.activate
def test_installation_is_looked_up_by_org(make_app, token_endpoint) -> None:
    app = make_app(installation_id=None, org="octo-org")
    responses.get(f"{API}/orgs/octo-org/installation", json={"id": 77, "app_slug": "microvm-check"})
    token_endpoint(responses, installation_id=77)
    app.installation_token()
    assert app.installation_id() == 77
    assert [call.request.url for call in responses.calls] == [
        f"{API}/orgs/octo-org/installation",
        f"{API}/app/installations/77/access_tokens",
    ]


@responses.activate
def test_app_not_installed_on_org_says_where_to_install(make_app) -> None:
    app = make_app(installation_id=None, org="octo-org", app_slug="microvm-check")
    responses.get(f"{API}/orgs/octo-org/installation", json={"message": "Not Found"}, status=404)
    with pytest.raises(NotFound, match="^the App is not installed on org octo-org: install it at ") as err:
        app.installation_token()
    assert "not installed on org octo-org" in str(err.value)
    assert "https://github.com/apps/microvm-check/installations/new" in str(err.value)


@responses.activate
def test_install_link_asks_github_for_the_slug(make_app, operations) -> None:
    app = make_app(installation_id=None, org="octo-org")
    responses.get(f"{API}/orgs/octo-org/installation", json={"message": "Not Found"}, status=404)
    # GET /app answers the App ("integration") object; its shape is the `app` of a check run.
    integration = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")["app"]
    responses.get(f"{API}/app", json=integration)
    with pytest.raises(NotFound, match="https://github.com/apps/octoapp/installations/new"):
        app.installation_token()


@responses.activate
def test_install_link_without_a_slug_still_explains(make_app) -> None:
    app = make_app(installation_id=None, org="octo-org")
    responses.get(f"{API}/orgs/octo-org/installation", json={"message": "Not Found"}, status=404)
    responses.get(f"{API}/app", status=500)
    with pytest.raises(NotFound, match="apps/<app-slug>/installations/new"):
        app.installation_token()


@responses.activate
def test_uninstalled_installation_id_is_explained(app) -> None:
    url = f"{API}/app/installations/{INSTALLATION_ID}/access_tokens"
    responses.post(url, json={"message": "Not Found"}, status=404)
    with pytest.raises(NotFound, match="uninstalled"):
        app.installation_token()


def test_settings_build_the_app_for_their_api_url(tmp_path, private_pem) -> None:
    from runner.github.config import load_settings

    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 7\nprivate_key_path: {key}\napi_url: https://ghe.example/api/v3/\n")
    app = load_settings(config, env={}).app()
    assert app.credentials.app_id == 7
    assert app.as_app.api_url == app.as_installation.api_url == "https://ghe.example/api/v3"
