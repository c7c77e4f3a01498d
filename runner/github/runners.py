"""Registering the host runner with the organisation, and finding it again.

Labels decide which jobs reach this host, so they are the one thing registration must get right:
`runs-on: [self-hosted, microvm]` jobs land here and nowhere else, and `runners` marks ours by them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.github.client import GitHubClient
from runner.github.errors import GitHubError, NotFound, ValidationFailed

REDACTED = "<redacted>"
DEFAULT_RUNNER_GROUP_ID = 1  # GitHub's "Default" group


@dataclass(frozen=True)
class RunnerToken:
    token: str
    expires_at: str


@dataclass(frozen=True)
class Runner:
    id: int
    name: str
    os: str
    status: str
    busy: bool
    labels: tuple[str, ...]

    def is_ours(self, our_labels: Iterable[str]) -> bool:
        return bool({label.lower() for label in our_labels} & {label.lower() for label in self.labels})


@dataclass(frozen=True)
class JitConfig:
    runner: Runner
    encoded_jit_config: str


def _runner(body: dict[str, Any]) -> Runner:
    return Runner(
        id=int(body["id"]),
        name=str(body.get("name", "")),
        os=str(body.get("os", "")),
        status=str(body.get("status", "")),
        busy=bool(body.get("busy", False)),
        labels=tuple(str(label.get("name", "")) for label in body.get("labels", []) if isinstance(label, dict)),
    )


class RunnerAdmin:
    """The org-level self-hosted runner endpoints, with errors that say what to do."""

    def __init__(self, client: GitHubClient, org: str) -> None:
        self.client = client
        self.org = org

    def registration_token(self) -> RunnerToken:
        body = self._post("registration-token", None)
        return RunnerToken(token=str(body["token"]), expires_at=str(body["expires_at"]))

    def remove_token(self) -> RunnerToken:
        body = self._post("remove-token", None)
        return RunnerToken(token=str(body["token"]), expires_at=str(body["expires_at"]))

    def jit_config(
        self, name: str, labels: Sequence[str], runner_group_id: int, work_folder: str = "_work"
    ) -> JitConfig:
        request = {"name": name, "runner_group_id": runner_group_id, "labels": list(labels), "work_folder": work_folder}
        body = self._post("generate-jitconfig", request)
        return JitConfig(runner=_runner(body["runner"]), encoded_jit_config=str(body["encoded_jit_config"]))

    def list(self) -> list[Runner]:
        return [_runner(item) for item in self.client.paginate(self._path(""), "runners")]

    def find(self, name: str) -> Runner | None:
        return next((r for r in self.list() if r.name == name), None)

    def delete(self, runner_id: int) -> None:
        try:
            self.client.delete(self._path(f"/{runner_id}"))
        except ValidationFailed as exc:
            raise ValidationFailed(
                f"GitHub refused to delete runner {runner_id} of org {self.org} (is it running a job? "
                f"wait for the job or stop the runner first): {exc}",
                status=exc.status,
            ) from exc

    def _post(self, what: str, body: dict[str, object] | None) -> dict[str, Any]:
        try:
            answer = self.client.post(self._path(f"/{what}"), body)
        except NotFound as exc:
            raise NotFound(
                f"org {self.org} was not found or the App cannot manage its runners: check the org name and "
                f"give the App the organisation permission 'Self-hosted runners: read and write' ({exc})",
                status=exc.status,
            ) from exc
        if not isinstance(answer, dict):
            raise GitHubError(f"GitHub answered POST {self._path(f'/{what}')} with JSON that is not an object: "
                              "is the API root a GitHub API?")
        return answer

    def _path(self, rest: str) -> str:
        return f"/orgs/{self.org}/actions/runners{rest}"


@dataclass(frozen=True)
class RunnerCommand:
    """A command for the runner's own scripts; the secret travels in the environment, not in argv,
    so it stays out of `ps` and out of shell history."""

    argv: tuple[str, ...]
    secret_env: str
    secret: str

    def display(self, show_secret: bool = False) -> str:
        value = self.secret if show_secret else REDACTED
        return f"{self.secret_env}={shlex.quote(value)} {shlex.join(self.argv)}"

    def run(self, runner_dir: Path) -> int:
        script = runner_dir / self.argv[0]
        if not script.is_file():
            raise GitHubError(
                f"{script} does not exist: --runner-dir must be the unpacked actions/runner release directory"
            )
        env = {**os.environ, self.secret_env: self.secret}
        return subprocess.run(self.argv, cwd=runner_dir, env=env, check=False).returncode


def config_command(
    org_url: str, token: RunnerToken, name: str, labels: Sequence[str], group: str | None
) -> RunnerCommand:
    argv = ["./config.sh", "--unattended", "--replace", "--url", org_url, "--name", name, "--labels", ",".join(labels)]
    if group:
        argv += ["--runnergroup", group]
    return RunnerCommand(argv=tuple(argv), secret_env="ACTIONS_RUNNER_INPUT_TOKEN", secret=token.token)


def remove_command(token: RunnerToken) -> RunnerCommand:
    return RunnerCommand(argv=("./config.sh", "remove"), secret_env="ACTIONS_RUNNER_INPUT_TOKEN", secret=token.token)


def jit_run_command(jit: JitConfig) -> RunnerCommand:
    return RunnerCommand(argv=("./run.sh",), secret_env="ACTIONS_RUNNER_INPUT_JITCONFIG", secret=jit.encoded_jit_config)
