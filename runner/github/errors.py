"""Errors from GitHub, worded so the operator knows what failed and what to do next.

`GitHubError`, their base, is the GitHub area's base in `runner.errors` (re-exported here): the CLI
prints them as one line instead of a traceback; the webhook server and the guard catch them too and
report them in their own channels.
"""

from __future__ import annotations

from runner.errors import GitHubError

__all__ = ["GitHubError", "Unauthorized", "Forbidden", "NotFound", "ValidationFailed", "RateLimited", "Unavailable"]


class Unauthorized(GitHubError):
    """401: GitHub did not accept our JWT or token."""


class Forbidden(GitHubError):
    """403 that is not a rate limit: the App lacks a permission or the resource is off limits."""


class NotFound(GitHubError):
    """404: GitHub also answers 404 for resources the App may not see, so callers add context."""


class ValidationFailed(GitHubError):
    """422: GitHub rejected the request body."""


class RateLimited(GitHubError):
    """A rate limit whose reset is further away than we are willing to wait."""


class Unavailable(GitHubError):
    """GitHub kept failing (5xx or no connection) after every retry."""
