"""Authenticating as the organisation's GitHub App: the App JWT and cached installation tokens.

The JWT follows GitHub's documented rules (RS256, `iat` 60 s in the past against clock drift, `exp`
no more than 10 minutes ahead, `iss` the client ID or else the app ID). Installation tokens last an
hour; we reuse one until shortly before it expires so a burst of webhooks costs one token request.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jwt
import requests

from runner.github.client import DEFAULT_API_URL, DEFAULT_RETRY, Clock, GitHubClient, RetryPolicy, Sleep
from runner.github.errors import GitHubError, NotFound

JWT_BACKDATE = 60  # GitHub's recommendation against clock drift
JWT_LIFETIME = 540  # under GitHub's 10-minute ceiling, so a slightly fast local clock stays valid
TOKEN_REFRESH_MARGIN = 300  # never hand out a token that may expire during the request using it


@dataclass(frozen=True)
class AppCredentials:
    """Who the App is; `issuer` is the client ID when known (GitHub's recommendation) or the app ID."""

    private_key_pem: str
    app_id: int | None = None
    client_id: str | None = None
    installation_id: int | None = None
    org: str | None = None
    app_slug: str | None = None

    @property
    def issuer(self) -> str:
        if self.client_id:
            return self.client_id
        if self.app_id is not None:
            return str(self.app_id)
        raise GitHubError("GitHub App credentials need a client_id or an app_id: set one in the config")

    @classmethod
    def from_key_file(cls, key_path: Path, **fields: object) -> AppCredentials:
        try:
            pem = key_path.read_text()
        except OSError as exc:
            raise GitHubError(
                f"cannot read the GitHub App private key {key_path}: {exc.strerror}; download a key "
                "from the App's settings page and point private_key_path at it"
            ) from exc
        return cls(private_key_pem=pem, **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class InstallationToken:
    token: str
    expires_at: float


def parse_timestamp(value: str) -> float:
    """GitHub's ISO 8601 timestamps (`...Z` or with an offset) as Unix seconds."""
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError) as exc:
        raise GitHubError(f"GitHub sent an unreadable timestamp {value!r}") from exc


class GitHubApp:
    """The App's two identities: `as_app` (JWT) for App endpoints, `as_installation` for the org."""

    def __init__(
        self,
        credentials: AppCredentials,
        *,
        api_url: str = DEFAULT_API_URL,
        session: requests.Session | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        clock: Clock = time.time,
        sleep: Sleep = time.sleep,
    ) -> None:
        self.credentials = credentials
        self.clock = clock
        self._lock = threading.Lock()
        self._token: InstallationToken | None = None
        self._installation_id = credentials.installation_id
        session = session or requests.Session()
        self.as_app = GitHubClient(self.jwt, api_url=api_url, session=session, retry=retry, clock=clock, sleep=sleep)
        self.as_installation = GitHubClient(
            self.installation_token,
            api_url=api_url,
            session=session,
            retry=retry,
            clock=clock,
            sleep=sleep,
            on_unauthorized=self.forget_token,
        )

    def jwt(self) -> str:
        now = int(self.clock())
        claims = {"iat": now - JWT_BACKDATE, "exp": now + JWT_LIFETIME, "iss": self.credentials.issuer}
        try:
            return jwt.encode(claims, self.credentials.private_key_pem, algorithm="RS256")
        except (ValueError, TypeError, jwt.PyJWTError) as exc:
            raise GitHubError(
                f"the GitHub App private key is not a usable RSA PEM key ({exc}): download a new key "
                "from the App's settings page"
            ) from exc

    def installation_id(self) -> int:
        """The configured installation, or the one GitHub reports for the configured org."""
        if self._installation_id is not None:
            return self._installation_id
        org = self.credentials.org
        if not org:
            raise GitHubError("set installation_id or org in the GitHub App config")
        try:
            body = self.as_app.get(f"/orgs/{org}/installation")
        except NotFound as exc:
            raise NotFound(f"the App is not installed on org {org}: install it at {self.install_url()}") from exc
        self._installation_id = int(body["id"])
        return self._installation_id

    def install_url(self) -> str:
        """Where an org admin installs the App; its slug is asked from GitHub when not configured."""
        slug = self.credentials.app_slug
        if not slug:
            try:
                answer = self.as_app.get("/app")
                slug = answer.get("slug") if isinstance(answer, dict) else None
            except GitHubError:
                slug = None
        if not isinstance(slug, str) or not re.fullmatch(r"[a-z0-9-]{1,100}", slug):
            slug = "<app-slug>"
        return f"https://github.com/apps/{slug}/installations/new"

    def installation_token(self) -> str:
        with self._lock:
            if self._token is None or self.clock() >= self._token.expires_at - TOKEN_REFRESH_MARGIN:
                self._token = self._new_token()
            return self._token.token

    def forget_token(self) -> None:
        """Drop the cached token after a 401 (revoked or expired early): the next call mints one."""
        with self._lock:
            self._token = None

    def _new_token(self) -> InstallationToken:
        installation = self.installation_id()
        try:
            body = self.as_app.post(f"/app/installations/{installation}/access_tokens")
        except NotFound as exc:
            raise NotFound(
                f"installation {installation} of the App was not found: the App may have been uninstalled; "
                f"install it at {self.install_url()} and update installation_id"
            ) from exc
        return InstallationToken(token=str(body["token"]), expires_at=parse_timestamp(str(body["expires_at"])))
