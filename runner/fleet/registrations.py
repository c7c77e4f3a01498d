"""This host's runners as GitHub lists them: the registrations the fleet must still take back.

A runner GitHub did not remove itself (one that died, was retired, or that a dead predecessor left
listed) is deregistered here. GitHub refuses while a job still holds the runner and may not answer at
all, so every id stays noted until a delete goes through, and is retried on each of the fleet's passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from runner.github.errors import GitHubError, NotFound, ValidationFailed
from runner.github.runners import RunnerAdmin

log = logging.getLogger(__name__)


class Registrations:
    """The ids of this host's runners to deregister, and the one sweep for a predecessor's."""

    def __init__(self, admin: RunnerAdmin, org: str, name_prefix: str) -> None:
        self._admin, self._org, self._prefix = admin, org, name_prefix + "-"
        self._stale: set[int] = set()  # GitHub runner ids of ours to deregister
        self.swept = False  # the predecessor's runners were looked for (GitHub answered once)

    @property
    def stale(self) -> list[int]:
        """What is still to deregister, for the status."""
        return sorted(self._stale)

    def sweep(self, ours: Iterable[int]) -> None:
        """Note this host's runners that GitHub still lists and this fleet does not run (a predecessor's);
        when GitHub cannot be asked, `swept` stays False and the next pass tries again."""
        running = set(ours)
        try:
            listed = self._admin.list()
        except GitHubError as exc:
            log.error("cannot list org %s's runners to clean up after a previous service (trying again): %s",
                      self._org, exc)
            return
        for found in listed:
            if found.name.startswith(self._prefix) and found.id not in running:
                log.warning("deregistering runner %s (id %d, %s): left by a previous service",
                            found.name, found.id, found.status)
                self._stale.add(found.id)
        self.swept = True

    def note(self, github_id: int) -> None:
        """Deregister `github_id` on a later pass (GitHub just refused it)."""
        self._stale.add(github_id)

    def deregister(self, github_id: int) -> None:
        """Deregister `github_id` now, or on a later pass when GitHub will not yet."""
        self._stale.add(github_id)
        self.retry()

    def retry(self) -> None:
        for github_id in sorted(self._stale):
            try:
                self._admin.delete(github_id)
            except NotFound:
                pass
            except ValidationFailed as exc:  # busy: a job still holds it; GitHub frees it after the job
                log.info("runner id %d cannot be deregistered yet: %s", github_id, exc)
                continue
            except GitHubError as exc:
                log.warning("deregistering runner id %d failed (trying again): %s", github_id, exc)
                continue
            self._stale.discard(github_id)
