"""A small GitHub REST client on requests: authentication header, retries and actionable errors.

GitHub throttles with two mechanisms (primary limits announced by `x-ratelimit-*` headers, secondary
limits by `Retry-After` or only by a message) and has the odd 5xx; a client that gives up at once
drops webhooks and registrations, and one that waits without bound hangs the service. Every wait
here is bounded by `RetryPolicy`, and the clock and sleep are injectable so tests never wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import requests

from runner.github.errors import (
    Forbidden,
    GitHubError,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
USER_AGENT = "microvm-check"
MAX_ERROR_TEXT = 500  # GitHub's error messages are short; anything longer is noise in a log line


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try: `attempts` requests in all, exponential backoff capped at `max_wait`.

    A rate limit that resets further away than `max_wait` is not waited for: the caller gets a
    `RateLimited` error naming the reset time instead of a service that hangs for an hour.
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_wait: float = 60.0

    def backoff(self, attempt: int) -> float:
        return min(self.base_delay * (2.0**attempt), self.max_wait)


DEFAULT_RETRY = RetryPolicy()
Clock = Callable[[], float]
Sleep = Callable[[float], None]
TokenSource = Callable[[], str]


class GitHubClient:
    """Sends authenticated requests to one GitHub API root; `token` is called for every request."""

    def __init__(
        self,
        token: TokenSource,
        *,
        api_url: str = DEFAULT_API_URL,
        session: requests.Session | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        clock: Clock = time.time,
        sleep: Sleep = time.sleep,
        timeout: float = 30.0,
        on_unauthorized: Callable[[], None] | None = None,
    ) -> None:
        self.token = token
        self.api_url = api_url.rstrip("/")
        self.session = session or requests.Session()
        self.retry = retry
        self.clock = clock
        self.sleep = sleep
        self.timeout = timeout
        self.on_unauthorized = on_unauthorized

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> requests.Response:
        """One API call with retries; returns the 2xx/3xx response or raises a `GitHubError`.

        `path` is relative to the API root, or an absolute URL under it (pagination links): the
        token is never sent anywhere else.
        """
        url = path if self._is_ours(path) else f"{self.api_url}{path}"
        if not url.startswith(self.api_url + "/"):
            raise GitHubError(f"refusing to send the GitHub token to {url[:200]!r}: not under {self.api_url}")
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                response = self.session.request(
                    method,
                    url,
                    json=json,
                    params=params,
                    headers={**self._headers(), **(headers or {})},
                    timeout=self.timeout,
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                if last:
                    raise Unavailable(
                        f"GitHub could not be reached for {method} {path} after {self.retry.attempts} "
                        f"attempts ({exc}): check the host's connection to {self.api_url}",
                        method=method,
                        path=path,
                    ) from exc
                self._wait(self.retry.backoff(attempt), method, path, "connection error")
                continue
            wait = self._retry_delay(response, attempt)
            if wait is None:
                return self._checked(response, method, path)
            if last:
                raise self._error(response, method, path)
            self._wait(wait, method, path, f"HTTP {response.status_code}")
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

    def get(self, path: str, **params: Any) -> Any:
        return _json(self.request("GET", path, params=params or None))

    def post(self, path: str, body: Any = None) -> Any:
        return _json(self.request("POST", path, json=body))

    def patch(self, path: str, body: Any) -> Any:
        return _json(self.request("PATCH", path, json=body))

    def delete(self, path: str) -> None:
        self.request("DELETE", path)

    def paginate(self, path: str, key: str | None, per_page: int = 100, **params: Any) -> Iterator[Any]:
        """Follow `Link: rel="next"` so callers see every item, not the first 30."""
        response = self.request("GET", path, params={**params, "per_page": per_page})
        while True:
            body = _json(response)
            items = body.get(key) if key and isinstance(body, dict) else body
            yield from items if isinstance(items, list) else []
            next_url = response.links.get("next", {}).get("url")
            if not next_url or not self._is_ours(next_url):
                return
            response = self.request("GET", next_url)

    def _is_ours(self, url: str) -> bool:
        return url.startswith(self.api_url + "/")

    def _headers(self) -> dict[str, str]:
        return {
            "Accept": "application/vnd.github+json",
            "Authorization": f"Bearer {self.token()}",
            "X-GitHub-Api-Version": API_VERSION,
            "User-Agent": USER_AGENT,
        }

    def _retry_delay(self, response: requests.Response, attempt: int) -> float | None:
        """Seconds to wait before trying again, or None when the answer is final."""
        status = response.status_code
        if status >= 500:
            return self.retry.backoff(attempt)
        if status not in (403, 429):
            return None
        retry_after = _header_number(response, "retry-after")
        if retry_after is not None:
            return self._bounded(max(retry_after, 0.0), response)
        if response.headers.get("x-ratelimit-remaining") == "0":
            reset = _header_number(response, "x-ratelimit-reset")
            if reset is not None:
                return self._bounded(max(reset - self.clock(), 0.0) + 1.0, response)
        if status == 429 or "secondary rate limit" in _message(response).lower():
            return self.retry.backoff(attempt)
        return None

    def _bounded(self, wait: float, response: requests.Response) -> float:
        if wait > self.retry.max_wait:
            raise RateLimited(
                f"GitHub rate limit: asked to wait {wait:.0f} s (more than the {self.retry.max_wait:.0f} s "
                f"we wait) for {response.url}; "
                f"try again later: {_message(response)}",
                status=response.status_code,
            )
        return wait

    def _wait(self, seconds: float, method: str, path: str, why: str) -> None:
        log.info("GitHub %s %s: %s, retrying in %.1f s", method, path, why, seconds)
        self.sleep(seconds)

    def _checked(self, response: requests.Response, method: str, path: str) -> requests.Response:
        if response.status_code < 400:
            return response
        if response.status_code == 401 and self.on_unauthorized:
            self.on_unauthorized()
        raise self._error(response, method, path)

    def _error(self, response: requests.Response, method: str, path: str) -> GitHubError:
        status = response.status_code
        where = f"{method} {path}"
        detail = _message(response)
        kinds: dict[int, tuple[type[GitHubError], str]] = {
            401: (Unauthorized, "check the App ID/client ID, the private key and this host's clock"),
            403: (Forbidden, "check the permissions granted to the App installation"),
            404: (NotFound, "check the name, and that the App is installed with access to it"),
            422: (ValidationFailed, "the request was rejected as invalid"),
        }
        if status in (403, 429) and _is_rate_limited(response):
            return RateLimited(
                f"GitHub rate limit still exceeded for {where} after {self.retry.attempts} attempts: {detail}",
                status=status,
                method=method,
                path=path,
            )
        if status >= 500:
            return Unavailable(
                f"GitHub failed {where} with {status} after {self.retry.attempts} attempts: try again later",
                status=status,
                method=method,
                path=path,
            )
        kind, hint = kinds.get(status, (GitHubError, "unexpected answer"))
        return kind(f"GitHub {status} for {where}: {detail} ({hint})", status=status, method=method, path=path)


def _is_rate_limited(response: requests.Response) -> bool:
    return (
        response.status_code == 429
        or "retry-after" in response.headers
        or response.headers.get("x-ratelimit-remaining") == "0"
        or "rate limit" in _message(response).lower()
    )


def _header_number(response: requests.Response, name: str) -> float | None:
    value = response.headers.get(name)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _message(response: requests.Response) -> str:
    """GitHub's own explanation ("message" plus "errors"), bounded, or the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:MAX_ERROR_TEXT].strip() or response.reason or ""
    if not isinstance(body, dict):
        return str(body)[:MAX_ERROR_TEXT]
    text = str(body.get("message", ""))
    if body.get("errors"):
        text += f" {body['errors']}"
    return text[:MAX_ERROR_TEXT]


def _json(response: requests.Response) -> Any:
    """The body as JSON; None for an empty body (204, 202 without content)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as exc:
        raise GitHubError(
            f"GitHub answered {response.request.method} {response.url} with {response.status_code} "
            "but the body is not JSON: is api_url pointing at the GitHub API?"
        ) from exc
