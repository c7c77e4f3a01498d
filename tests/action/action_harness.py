"""Runs action.yml the way the GitHub runner runs a composite action, in a simulated Actions job.

For each `run` step: the step's `env` with `${{ inputs.* }}` evaluated (defaults applied, required
inputs enforced), a script file run as `bash --noprofile --norc -eo pipefail {0}` (the runner's
`shell: bash`), in GITHUB_WORKSPACE, with its own GITHUB_OUTPUT file; then the action's outputs are
evaluated from `${{ steps.<id>.outputs.<name> }}`. Any other expression fails the test, so action.yml
cannot quietly rely on something this harness does not model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tests.action.gha_runner_model import ICU_IGNORABLE, RunnerModel

if TYPE_CHECKING:
    from runner.jobapi.client import JobClient
    from runner.jobapi.contract import JobRecord

ROOT = Path(__file__).resolve().parents[2]
ACTION = ROOT / "action.yml"
PYTHON = ROOT / ".venv" / "bin" / "python"
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
FORK_PR = "listendev-lstn.pull_request.opened.from-fork.json"
# Secrets a real runner's environment holds; none of them may reach the guest.
HOST_SECRETS = {
    "GITHUB_TOKEN": "ghs_hostSecretNeverInTheGuest0001",
    "ACTIONS_RUNTIME_TOKEN": "hostRuntimeTokenNeverInTheGuest0002",
    "ACTIONS_ID_TOKEN_REQUEST_TOKEN": "hostOidcTokenNeverInTheGuest0003",
    "HOST_ONLY_SECRET": "hostOnlySecretNeverInTheGuest0004",
}


def parse_output_file(text: str) -> dict[str, str]:
    """The runner's reading of a $GITHUB_OUTPUT file (name=value lines and name<<DELIM blocks)."""
    result, lines, i = {}, text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            end = lines.index(delim, i + 1)
            result[name] = "\n".join(lines[i + 1 : end])
            i = end + 1
        elif "=" in line:
            name, value = line.split("=", 1)
            result[name] = value
            i += 1
        else:
            i += 1
    return result


def _evaluate(text: str, context: dict[str, dict[str, str]]) -> str:
    def one(match: re.Match[str]) -> str:
        parts = match.group(1).split(".")
        if parts[0] == "inputs" and len(parts) == 2:
            return context["inputs"][parts[1]]
        if parts[0] == "steps" and len(parts) == 4 and parts[2] == "outputs":
            return context["steps"].get(parts[1], {}).get(parts[3], "")
        raise AssertionError(f"the harness does not model the expression {match.group(0)!r}")
    return EXPRESSION.sub(one, text)


@dataclass
class Simulation:
    """A simulated Actions job around one use of the action."""

    workspace: Path
    temp: Path
    event_payload: dict[str, Any]
    event_name: str = "pull_request"
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        pull = self.event_payload.get("pull_request", {})
        event_path = self.temp / "event.json"
        event_path.write_text(json.dumps(self.event_payload))
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.temp),
            "CI": "true",
            "GITHUB_ACTIONS": "true",
            "GITHUB_WORKSPACE": str(self.workspace),
            "GITHUB_EVENT_PATH": str(event_path),
            "GITHUB_EVENT_NAME": self.event_name,
            "GITHUB_REPOSITORY": pull.get("base", {}).get("repo", {}).get("full_name", "octo/repo"),
            "GITHUB_SHA": pull.get("merge_commit_sha") or "f" * 40,
            "GITHUB_REF": f"refs/pull/{pull.get('number', 1)}/merge",
            "GITHUB_RUN_ID": "4242",
            "GITHUB_RUN_ATTEMPT": "1",
            "GITHUB_JOB": "check",
            "GITHUB_STEP_SUMMARY": str(self.temp / "summary.md"),
            "RUNNER_TEMP": str(self.temp),
            "MICROVM_CHECK_PYTHON": str(PYTHON),
            **HOST_SECRETS,
            **self.extra_env,
        }


@dataclass
class StepProcess:
    process: subprocess.Popen
    output_file: Path
    step_id: str


@dataclass
class ActionResult:
    returncode: int
    log: str
    outputs: dict[str, str]
    summary: str


def _inputs(metadata: dict[str, Any], given: dict[str, str]) -> dict[str, str]:
    unknown = set(given) - set(metadata["inputs"])
    assert not unknown, f"not inputs of action.yml: {unknown}"
    values = {}
    for name, spec in metadata["inputs"].items():
        if name in given:
            values[name] = given[name]
        else:
            assert not spec.get("required"), f"input {name} is required"
            values[name] = spec.get("default", "")
    return values


def start(sim: Simulation, inputs: dict[str, str]) -> tuple[dict[str, Any], list[StepProcess]]:
    """Start the action's (single) run step; returns the metadata and the running step."""
    metadata = yaml.safe_load(ACTION.read_text())
    assert metadata["runs"]["using"] == "composite"
    context = {"inputs": _inputs(metadata, inputs), "steps": {}}
    steps = []
    for index, step in enumerate(metadata["runs"]["steps"]):
        assert step["shell"] == "bash" and "run" in step and "if" not in step
        output_file = sim.temp / f"output-{index}"
        output_file.touch()
        script = sim.temp / f"step-{index}.sh"
        script.write_text(_evaluate(step["run"], context))
        env = sim.env()
        env.update({k: _evaluate(str(v), context) for k, v in (step.get("env") or {}).items()})
        env["GITHUB_OUTPUT"] = str(output_file)
        process = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            cwd=sim.workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        steps.append(StepProcess(process, output_file, step.get("id", f"step{index}")))
    assert len(steps) == 1, "the harness runs one step at a time; extend it for more"
    return metadata, steps


def finish(sim: Simulation, metadata: dict[str, Any], steps: list[StepProcess], timeout: float = 900) -> ActionResult:
    step = steps[0]
    log, _ = step.process.communicate(timeout=timeout)
    step_outputs = {step.step_id: parse_output_file(step.output_file.read_text())}
    context = {"inputs": {}, "steps": step_outputs}
    outputs = {name: _evaluate(spec["value"], context) for name, spec in metadata["outputs"].items()}
    summary_path = sim.temp / "summary.md"
    summary = summary_path.read_text() if summary_path.exists() else ""
    return ActionResult(step.process.returncode, log.decode("utf-8", "replace"), outputs, summary)


def run_action(sim: Simulation, inputs: dict[str, str], timeout: float = 900) -> ActionResult:
    metadata, steps = start(sim, inputs)
    return finish(sim, metadata, steps, timeout)


def interrupt(steps: list[StepProcess], signum: int = signal.SIGINT) -> None:
    """What the runner does when a step is cancelled: SIGINT first, SIGTERM if that is ignored."""
    steps[0].process.send_signal(signum)


def wait_for_state(client: JobClient, state: str, job_id: str | None = None, timeout: float = 60.0,
                   interval: float = 0.1) -> JobRecord:
    """Poll the job service until the job (without `job_id`, the newest job) is in `state`; its record.

    Fails the test, with the last state seen, when `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    last: JobRecord | None = None
    while True:
        if job_id is None:
            jobs = client.list(limit=1)
            last = jobs[0] if jobs else None
        else:
            last = client.get(job_id)
        if last is not None and last.state == state:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"no job reached {state!r} within {timeout:g} s; last seen: "
                                 f"{None if last is None else last.state.value!r}")
        time.sleep(interval)


ACTION_COMMANDS = ("error", "warning", "notice")  # what the action itself may say outside the relay


def runner_commands(log: str) -> list[list[tuple[str, str]]]:
    """What the GitHub runner would execute from a step's log, per runner model (ordinal and ICU)."""
    results = []
    for model in (RunnerModel(), RunnerModel(ignorable=ICU_IGNORABLE),
                  RunnerModel(ignorable=ICU_IGNORABLE, include_leading=True)):
        model.feed(log)
        results.append(model.executed)
    return results


def assert_only_action_commands(log: str) -> None:
    """In every runner model only the relay's own frame and the action's annotations act as commands.

    The relay opens a group and stops commands, resumes them with its token at the end and closes the
    group; after that the action may only annotate. Guest lines must execute nothing at all.
    """
    for executed in runner_commands(log):
        names = [name for name, _ in executed]
        assert names[:4] == ["group", "stop-commands", "resume", "endgroup"], executed
        assert executed[2] == ("resume", executed[1][1].lower()), executed
        assert all(name in ACTION_COMMANDS for name in names[4:]), executed
