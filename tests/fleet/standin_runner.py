"""A stand-in for the GitHub runner's `run.sh --jitconfig ...`, for tests and the fleet benchmark.

It does what the real runner does with one just-in-time job, in the same order and with the same
files: it reads `.env` beside `run.sh` into its environment (Runner.Listener's LoadAndSetEnv), takes
its JIT config from `--jitconfig` or ACTIONS_RUNNER_INPUT_JITCONFIG, gets one job from "GitHub",
lays out `_work/<repo>/<repo>` as the job's workspace, runs ACTIONS_RUNNER_HOOK_JOB_STARTED there
(`bash -e HOOK`), runs the job's steps (`run:` as `bash --noprofile --norc -eo pipefail`, and
`uses: microvm-check` as action.yml's composite step, inputs evaluated with their defaults), runs
ACTIONS_RUNNER_HOOK_JOB_COMPLETED, and exits. GitHub cannot be reached from here, so the JIT config
the test's fake GitHub hands out names a queue directory: the runner claims a job file by renaming
it (one runner per job, as GitHub's broker does) and writes its result back into that file.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the runner directory (bin/..)
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def load_env(root: Path) -> None:
    env_file = root / ".env"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key:
                os.environ[key] = value


def jit_config(argv: list[str]) -> dict:
    encoded = argv[argv.index("--jitconfig") + 1] if "--jitconfig" in argv else os.environ.get(
        "ACTIONS_RUNNER_INPUT_JITCONFIG", "")
    if not encoded:
        sys.exit("standin runner: no --jitconfig and no ACTIONS_RUNNER_INPUT_JITCONFIG")
    return json.loads(base64.b64decode(encoded))


def claim(queue: Path, name: str) -> Path | None:
    """Wait for a job; None when the runner is told to stop (SIGTERM), as an idle runner would."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        for job in sorted((queue / "jobs").glob("*.json")):
            target = queue / "claimed" / f"{job.stem}.{name}.json"
            try:
                os.rename(job, target)
            except OSError:
                continue  # another runner took it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            return target
        time.sleep(0.05)
    return None


def job_env(job: dict, workspace: Path, temp: Path, name: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ACTIONS_RUNNER_INPUT_JITCONFIG", None)
    event_path = temp / "event.json"
    event_path.write_text(json.dumps(job["event_payload"]))
    env.update({
        "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(workspace),
        "GITHUB_EVENT_PATH": str(event_path), "GITHUB_EVENT_NAME": job["event"],
        "GITHUB_REPOSITORY": job["repository"], "GITHUB_SHA": "f" * 40, "GITHUB_REF": "refs/pull/1/merge",
        "GITHUB_RUN_ID": str(job["run_id"]), "GITHUB_RUN_ATTEMPT": str(job["run_attempt"]),
        "GITHUB_JOB": job["job"], "GITHUB_WORKFLOW_REF": job["workflow_ref"],
        "GITHUB_STEP_SUMMARY": str(temp / "summary.md"), "RUNNER_TEMP": str(temp), "RUNNER_NAME": name,
        "MICROVM_CHECK_PYTHON": job["python"],
    })
    return env


def run_hook(variable: str, workspace: Path, env: dict[str, str], log: list[str]) -> int:
    hook = os.environ.get(variable)
    if not hook:
        return 0
    done = subprocess.run(["bash", "-e", hook], cwd=workspace, env=env, capture_output=True, text=True)
    log.append(done.stdout + done.stderr)
    return done.returncode


def run_script(text: str, workspace: Path, env: dict[str, str], temp: Path, log: list[str]) -> tuple[int, dict]:
    script = temp / f"step-{len(log)}.sh"
    script.write_text(text)
    output = temp / f"output-{len(log)}"
    output.touch()
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=workspace,
                          env={**env, "GITHUB_OUTPUT": str(output)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace")
    log.append(done.stdout)
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return done.returncode, outputs


def run_action(action_yml: Path, given: dict[str, str], workspace: Path, env: dict[str, str], temp: Path,
               log: list[str]) -> int:
    """action.yml's composite `run` steps, with `${{ inputs.* }}` evaluated as the runner does."""
    import yaml

    metadata = yaml.safe_load(action_yml.read_text())
    inputs = {name: str(given.get(name, spec.get("default", ""))) for name, spec in metadata["inputs"].items()}
    evaluate = lambda text: EXPRESSION.sub(lambda m: inputs[m.group(1).split(".", 1)[1]], str(text))  # noqa: E731
    for step in metadata["runs"]["steps"]:
        step_env = {**env, **{key: evaluate(value) for key, value in (step.get("env") or {}).items()}}
        code, _ = run_script(evaluate(step["run"]), workspace, step_env, temp, log)
        if code != 0:
            return code
    return 0


def main(argv: list[str]) -> int:
    load_env(HERE)
    config = jit_config(argv)
    claimed = claim(Path(config["queue"]), config["name"])
    if claimed is None:
        return 0
    claimed_at = time.time()
    job = json.loads(claimed.read_text())
    repo = job["repository"].split("/")[1]
    workspace = HERE / "_work" / repo / repo
    temp = HERE / "_work" / "_temp"
    workspace.mkdir(parents=True)
    temp.mkdir(parents=True)
    for relative, text in job.get("files", {}).items():
        (workspace / relative).parent.mkdir(parents=True, exist_ok=True)
        (workspace / relative).write_text(text)
    env = job_env(job, workspace, temp, config["name"])
    log: list[str] = []
    result = {"runner": config["name"], "runner_id": config["runner_id"], "steps": [], "workspace": str(workspace),
              "claimed_at": claimed_at}
    if run_hook("ACTIONS_RUNNER_HOOK_JOB_STARTED", workspace, env, log) != 0:
        result["conclusion"] = "failure"
    else:
        for step in job["steps"]:
            result.setdefault("first_step_at", time.time())
            if "uses" in step:
                code = run_action(Path(job["action"]), step.get("with", {}), workspace, env, temp, log)
            else:
                code, _ = run_script(step["run"], workspace, env, temp, log)
            result["steps"].append(code)
            if code != 0:
                break
        result["conclusion"] = "success" if all(code == 0 for code in result["steps"]) else "failure"
    run_hook("ACTIONS_RUNNER_HOOK_JOB_COMPLETED", workspace, env, log)
    result["log"] = "".join(log)[-20000:]
    result["ended_at"] = time.time()
    claimed.write_text(json.dumps({**job, "result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
