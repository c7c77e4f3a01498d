"""`register`, `deregister` and `runners` against the documented runner endpoints."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import responses

from tests.github.github_fakes import API, INSTALLATION_ID, assert_valid_request, example
from tests.github.github_fakes import run_cli as main

ORG = "octo-org"
RUNNERS = f"{API}/orgs/{ORG}/actions/runners"
JIT_FRAGMENT = "POST_orgs_org_actions_runners_generate-jitconfig.json"
JIT_PATH = "/orgs/{org}/actions/runners/generate-jitconfig"


@pytest.fixture
def config(tmp_path, private_pem) -> Path:
    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    key.chmod(0o600)
    path = tmp_path / "github.yml"
    path.write_text(
        f"client_id: Iv1.8a61f9b3a7aba766\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n"
        f"org: {ORG}\nlabels: [microvm, no-gpu]\n"
    )
    return path


@pytest.fixture
def github(token_endpoint):
    with responses.RequestsMock() as mock:
        token_endpoint(mock)
        yield mock


@pytest.fixture
def runner_dir(tmp_path) -> Path:
    """A stand-in for the actions/runner directory whose scripts record how they were called."""
    directory = tmp_path / "actions-runner"
    directory.mkdir()
    for name in ("config.sh", "run.sh"):
        script = directory / name
        script.write_text(
            "#!/bin/sh\n"
            f'printf "%s\\n" "{name}" "$@" > "$(dirname "$0")/{name}.args"\n'
            'secret="$ACTIONS_RUNNER_INPUT_TOKEN$ACTIONS_RUNNER_INPUT_JITCONFIG"\n'
            f'printf "%s" "$secret" > "$(dirname "$0")/{name}.secret"\n'
            "exit 3\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return directory


def test_register_prints_the_config_command_with_the_token_redacted(github, config, capsys, operations) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/registration-token", "201")
    github.post(f"{RUNNERS}/registration-token", json=token, status=201)
    assert main(["register", "--config", str(config), "--name", "host-1"]) == 0
    out = capsys.readouterr().out
    assert token["token"] not in out
    assert f"expires at {token['expires_at']}" in out
    assert "ACTIONS_RUNNER_INPUT_TOKEN='<redacted>' ./config.sh --unattended --replace" in out
    assert f"--url https://github.com/{ORG} --name host-1 --labels microvm,no-gpu" in out
    assert "note: this is ONE runner: it takes one job at a time" in out


def test_register_show_token_prints_it(github, config, capsys, operations) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/registration-token", "201")
    github.post(f"{RUNNERS}/registration-token", json=token, status=201)
    assert main(["register", "--config", str(config), "--show-token", "--labels", "microvm"]) == 0
    assert f"ACTIONS_RUNNER_INPUT_TOKEN={token['token']} ./config.sh" in capsys.readouterr().out


def test_register_runs_config_sh_with_the_token_in_the_environment(github, config, runner_dir, operations) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/registration-token", "201")
    github.post(f"{RUNNERS}/registration-token", json=token, status=201)
    code = main(["register", "--config", str(config), "--runner-dir", str(runner_dir), "--name", "h",
                 "--runner-group", "microvms"])
    assert code == 3  # the script's own status comes back
    args = (runner_dir / "config.sh.args").read_text().split("\n")
    assert token["token"] not in args
    assert args[args.index("--runnergroup") + 1] == "microvms"
    assert args[args.index("--labels") + 1] == "microvm,no-gpu"
    assert (runner_dir / "config.sh.secret").read_text() == token["token"]


def test_register_installs_the_guard_hook(github, config, runner_dir, operations, capsys) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/registration-token", "201")
    github.post(f"{RUNNERS}/registration-token", json=token, status=201)
    (runner_dir / ".env").write_text("LANG=C.UTF-8\nACTIONS_RUNNER_HOOK_JOB_STARTED=/old/hook.sh\n")
    rules = runner_dir.parent / "rules.yml"
    argv = ["register", "--config", str(config), "--runner-dir", str(runner_dir), "--guard-rules", str(rules)]
    assert main(argv) == 3
    script = runner_dir / "microvm-check-guard.sh"
    assert (runner_dir / ".env").read_text() == f"LANG=C.UTF-8\nACTIONS_RUNNER_HOOK_JOB_STARTED={script}\n"
    assert script.stat().st_mode & 0o777 == 0o755
    text = script.read_text()
    assert f"-m runner.cli guard --config {config} --rules {rules}" in text
    assert "installed the fork guard" in capsys.readouterr().out


def test_installed_hook_runs_the_guard(tmp_path) -> None:
    """The script the runner will run: allows a same-repository pull request (no GitHub needed)."""
    import json
    import subprocess

    from runner.fleet.hook import guard_argv, install_guard_hook
    from tests.github.github_fakes import load_payload

    event = tmp_path / "event.json"
    event.write_text(json.dumps(load_payload("listendev-lstn.pull_request.opened.same-repo.reviewdog.json")))
    script = install_guard_hook(tmp_path, guard_argv(None, None))
    env = {"PATH": "/usr/bin:/bin", "GITHUB_EVENT_NAME": "pull_request", "GITHUB_EVENT_PATH": str(event),
           "GITHUB_REPOSITORY": "reviewdog/reviewdog"}
    allowed = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 0, allowed.stderr
    env["GITHUB_REPOSITORY"] = "someone/else"  # the event does not belong to this repository
    refused = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout.startswith("::error title=microvm-check guard::")


def test_register_jit_sends_the_documented_body(github, config, runner_dir, operations, capsys) -> None:
    answer = example(operations, "POST /orgs/{org}/actions/runners/generate-jitconfig", "201")
    call = github.post(f"{RUNNERS}/generate-jitconfig", json=answer, status=201)
    code = main(["register", "--config", str(config), "--jit", "--runner-group", "7", "--name", "vm-host",
                 "--runner-dir", str(runner_dir)])
    assert code == 3
    body = assert_valid_request(call.calls[0].request.body, JIT_FRAGMENT, JIT_PATH, "post")
    assert body == {"name": "vm-host", "runner_group_id": 7, "labels": ["microvm", "no-gpu"], "work_folder": "_work"}
    assert (runner_dir / "run.sh.secret").read_text() == answer["encoded_jit_config"]
    assert "id 23" in capsys.readouterr().out


def test_register_jit_needs_a_numeric_group(config, capsys) -> None:
    assert main(["register", "--config", str(config), "--jit", "--runner-group", "Default"]) == 1
    assert "numeric ID" in capsys.readouterr().err


def test_register_without_runner_scripts_says_what_runner_dir_is(github, config, tmp_path, operations, capsys) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/registration-token", "201")
    github.post(f"{RUNNERS}/registration-token", json=token, status=201)
    assert main(["register", "--config", str(config), "--runner-dir", str(tmp_path / "nothing")]) == 1
    assert "unpack the actions/runner release there" in capsys.readouterr().err


def test_register_in_an_unknown_org_explains_the_permission(github, config, capsys) -> None:
    github.post(f"{API}/orgs/nope/actions/runners/registration-token", json={"message": "Not Found"}, status=404)
    assert main(["register", "--config", str(config), "--org", "nope"]) == 1
    err = capsys.readouterr().err
    assert "org nope was not found" in err and "Self-hosted runners" in err


def test_jit_validation_failure_is_reported(github, config, capsys) -> None:
    answer = {"message": "Validation Failed", "errors": ["name taken"]}
    github.post(f"{RUNNERS}/generate-jitconfig", json=answer, status=422)
    assert main(["register", "--config", str(config), "--jit"]) == 1
    assert "name taken" in capsys.readouterr().err


def test_runners_marks_ours_by_label(github, config, capsys, operations) -> None:
    github.get(RUNNERS, json=example(operations, "GET /orgs/{org}/actions/runners", "200"))
    assert main(["runners", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    mac = next(line for line in lines if "mac_runner" in line)
    linux = next(line for line in lines if "linux_runner" in line)
    assert mac.startswith("*") and not linux.startswith("*")  # mac_runner has our no-gpu label
    assert "online, busy" in linux
    assert lines[-1].startswith("2 runner(s) in org octo-org")


def test_deregister_deletes_the_named_runner(github, config, capsys, operations) -> None:
    github.get(RUNNERS, json=example(operations, "GET /orgs/{org}/actions/runners", "200"))
    delete = github.delete(f"{RUNNERS}/24", status=204)
    assert main(["deregister", "--config", str(config), "--name", "mac_runner"]) == 0
    assert delete.call_count == 1
    assert "deleted runner mac_runner (id 24)" in capsys.readouterr().out


def test_deregister_unknown_runner_is_an_error(github, config, capsys, operations) -> None:
    github.get(RUNNERS, json=example(operations, "GET /orgs/{org}/actions/runners", "200"))
    assert main(["deregister", "--config", str(config), "--name", "ghost"]) == 1
    assert "no runner named 'ghost'" in capsys.readouterr().err


def test_deregister_busy_runner_explains(github, config, capsys, operations) -> None:
    github.get(RUNNERS, json=example(operations, "GET /orgs/{org}/actions/runners", "200"))
    github.delete(f"{RUNNERS}/23", status=422, json={"message": "Validation Failed"})
    assert main(["deregister", "--config", str(config), "--name", "linux_runner"]) == 1
    assert "running a job" in capsys.readouterr().err


def test_deregister_with_runner_dir_runs_config_remove(github, config, runner_dir, operations) -> None:
    token = example(operations, "POST /orgs/{org}/actions/runners/remove-token", "201")
    github.post(f"{RUNNERS}/remove-token", json=token, status=201)
    assert main(["deregister", "--config", str(config), "--runner-dir", str(runner_dir)]) == 3
    assert (runner_dir / "config.sh.args").read_text().split("\n")[:2] == ["config.sh", "remove"]
    assert (runner_dir / "config.sh.secret").read_text() == token["token"]


def test_missing_config_is_explained(tmp_path, capsys) -> None:
    assert main(["runners", "--config", str(tmp_path / "absent.yml")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_environment_overrides_the_config(config, monkeypatch) -> None:
    from runner.github.config import load_settings

    env = {"MICROVM_CHECK_GITHUB_CONFIG": str(config), "MICROVM_CHECK_GITHUB_ORG": "other-org",
           "MICROVM_CHECK_GITHUB_INSTALLATION_ID": "9"}
    settings = load_settings(env=env)
    assert (settings.org, settings.installation_id, settings.labels) == ("other-org", 9, ("microvm", "no-gpu"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("client_id: x\n", "private_key_path is not set"),
        ("private_key_path: /k.pem\n", "neither client_id nor app_id"),
        ("private_key_path: /k.pem\napp_id: abc\n", "app_id"),
        ("private_key_path: /k.pem\napp_id: 1\nlabels: []\n", "labels"),
        ("- a list\n", "mapping"),
        ("a: [unclosed\n", r"github.yml:2:1: YAML syntax error"),
    ],
)
def test_bad_config_is_explained(tmp_path, text, message) -> None:
    from runner.github.config import load_settings
    from runner.github.errors import GitHubError

    path = tmp_path / "github.yml"
    path.write_text(text)
    with pytest.raises(GitHubError, match=message):
        load_settings(path, env={})
