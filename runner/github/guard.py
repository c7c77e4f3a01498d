"""The host runner's job-started hook: refuse untrusted workflows before any step runs.

A `pull_request` job runs the workflow file as the pull request has it. From a fork, that file is
written by a stranger, who could drop `uses: org/microvm-check@v1` and run commands straight on this
host; or leave it alone and rewrite a workflow it calls or a local action it uses. The guard
therefore refuses a fork's `pull_request` (and `pull_request_review[_comment]`) job when anything
under `.github/` differs between the pull request's base and head (by tree sha), unless the
repository's rules let forks change those paths (`fork_may_change`), and always when the workflow
or anything it reaches (called workflows, local actions: see reach.py) differs. Per repository it
also refuses jobs from untrusted triggers or authors. Every value read from the event file or the
environment is checked before use; anything unreadable refuses the job (the guard fails closed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.github import reach
from runner.github.client import GitHubClient
from runner.github.contents import SHA_RE, check_path, entry_sha
from runner.github.errors import GitHubError
from runner.github.jobs import REPOSITORY_RE
from runner.github.reach import GITHUB_DIR, Change, Revisions, github_changes, reached_changes

# The guard rules file the `guard` command and the service read when no --rules is given.
GUARD_RULES_ENV = "MICROVM_CHECK_GUARD_RULES"
MAX_EVENT_BYTES = 25 * 1024 * 1024  # GitHub caps webhook payloads at 25 MB; event files are the same payloads
# Events that run the workflow as the pull request has it; pull_request_target runs the base's.
PR_EVENTS = frozenset({"pull_request", "pull_request_review", "pull_request_review_comment"})
PR_CARRYING_EVENTS = PR_EVENTS | {"pull_request_target"}
WORKFLOW_REF_RE = re.compile(
    r"^(?P<repo>[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)/(?P<path>\.github/workflows/[^@\x00-\x1f]+)@(?P<ref>\S+)\Z"
)
SAFE_PATH_RE = re.compile(r"^\.github/workflows/(?!.*\.\.)[A-Za-z0-9_./ -]{1,255}\Z")
HOW_TO_RUN_SAFELY = (
    "To run checks for fork pull requests on this host, trigger the workflow with `on: pull_request_target`, "
    "check out the PR head with actions/checkout (`ref: ${{ github.event.pull_request.head.sha }}`, "
    "`persist-credentials: false`) and run its commands only through `uses: org/microvm-check@v1`, "
    "which runs them in a disposable VM."
)


class GuardError(GitHubError):
    """The job's context could not be read or checked: the guard refuses rather than guesses."""


@dataclass(frozen=True)
class RepoRules:
    """Per-repository requirements; empty tuples mean "no requirement".

    `protected_paths` are files or directories (e.g. scripts the workflow runs on the host) that a
    fork's pull request must not change either, beyond `.github/` and what the workflow reaches,
    which are always compared. `fork_may_change` are paths under `.github/` that nothing runs
    (issue templates, CODEOWNERS, ...) which a fork may change; never workflows or `.github/actions`.
    """

    trusted_triggers: tuple[str, ...] = ()
    author_associations: tuple[str, ...] = ()
    protected_paths: tuple[str, ...] = ()
    fork_may_change: tuple[str, ...] = ()


@dataclass(frozen=True)
class GuardRules:
    repositories: Mapping[str, RepoRules] = field(default_factory=dict)
    default: RepoRules = RepoRules()

    def for_repository(self, repository: str) -> RepoRules:
        lowered = {name.lower(): rules for name, rules in self.repositories.items()}
        return lowered.get(repository.lower(), self.default)


@dataclass(frozen=True)
class PullRequest:
    number: int
    head_repo: str | None  # None when the fork was deleted
    base_repo: str
    head_sha: str
    base_sha: str
    author_association: str

    @property
    def from_fork(self) -> bool:
        return self.head_repo is None or self.head_repo.lower() != self.base_repo.lower()


@dataclass(frozen=True)
class JobContext:
    event_name: str
    repository: str
    workflow_path: str | None
    pull_request: PullRequest | None


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reasons: tuple[str, ...] = ()


def load_rules(path: Path | None) -> GuardRules:
    """Rules file: `default:` and `repositories: {owner/repo: {...}}`, each with optional
    `trusted_triggers`, `author_associations`, `protected_paths` and `fork_may_change` lists.
    No file means no extra rules."""
    if path is None:
        return GuardRules()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise GuardError(f"cannot read guard rules {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise GuardError(f"guard rules {path} are not valid YAML: {exc}") from exc
    if not isinstance(raw, dict) or not set(raw) <= {"default", "repositories"}:
        raise GuardError(f"guard rules {path} must be a mapping with 'default' and/or 'repositories'")
    repos = raw.get("repositories") or {}
    if not isinstance(repos, dict):
        raise GuardError(f"'repositories' in {path} must map owner/repo to rules")
    return GuardRules(
        repositories={str(name): _repo_rules(value, f"{path}: {name}") for name, value in repos.items()},
        default=_repo_rules(raw.get("default") or {}, f"{path}: default"),
    )


RULE_KEYS = ("trusted_triggers", "author_associations", "protected_paths", "fork_may_change")
NEVER_MAY_CHANGE = (".github/workflows", ".github/actions")


def _repo_rules(raw: Any, where: str) -> RepoRules:
    if not isinstance(raw, dict) or not set(raw) <= set(RULE_KEYS):
        raise GuardError(f"{where} must be a mapping with any of {', '.join(RULE_KEYS)}")
    lists = {}
    for key in RULE_KEYS:
        value = raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            raise GuardError(f"{where}: {key} must be a list of names")
        lists[key] = tuple(item.upper() if key == "author_associations" else item for item in value)
    for path in lists["protected_paths"]:
        try:
            check_path(path)
        except GitHubError as exc:
            raise GuardError(f"{where}: protected_paths: {exc}") from exc
    lists["fork_may_change"] = tuple(_may_change(path, where) for path in lists["fork_may_change"])
    return RepoRules(**lists)


def _may_change(path: str, where: str) -> str:
    """A path under `.github/` that is not, and is not inside, the workflows or `.github/actions`."""
    path = path.rstrip("/")
    try:
        check_path(path)
    except GitHubError as exc:
        raise GuardError(f"{where}: fork_may_change: {exc}") from exc
    if not path.startswith(f"{GITHUB_DIR}/"):
        raise GuardError(f"{where}: fork_may_change: {path!r} is not under {GITHUB_DIR}/ (only .github is compared)")
    if any(path == never or path.startswith(f"{never}/") for never in NEVER_MAY_CHANGE):
        raise GuardError(f"{where}: fork_may_change: {path!r} holds workflows or actions, which forks may never change")
    return path


def job_context(env: Mapping[str, str]) -> JobContext:
    """The job's identity from the runner's environment and event file, validated."""
    event = _read_event(env.get("GITHUB_EVENT_PATH", ""))
    return _context(env.get("GITHUB_EVENT_NAME", ""), env.get("GITHUB_REPOSITORY", ""),
                    env.get("GITHUB_WORKFLOW_REF", ""), event)


def _context(event_name: str, repository: str, workflow_ref: str, event: dict[str, Any]) -> JobContext:
    if not re.fullmatch(r"[a-z_]{1,64}", event_name):
        raise GuardError(f"GITHUB_EVENT_NAME {event_name[:64]!r} is missing or malformed")
    if not REPOSITORY_RE.match(repository):
        raise GuardError(f"GITHUB_REPOSITORY {repository[:200]!r} is missing or malformed")
    pull_request = _pull_request(event, repository) if event_name in PR_CARRYING_EVENTS else None
    return JobContext(event_name, repository, _workflow_path(workflow_ref, repository), pull_request)


# -- the guard run by the service, for fleet runners ----------------------------------------------
# A fleet runner's user must not read the App's private key, so its job-started hook cannot ask GitHub
# itself: it sends what the guard reads of the job (its names and the event's pull request, nothing
# else) to the service, which runs the same checks with the App and answers allow or refuse.


def reported_context(env: Mapping[str, str]) -> dict[str, Any]:
    """What the hook sends: the job's names and the event's pull request, cut to the fields the guard reads."""
    event = _read_event(env.get("GITHUB_EVENT_PATH", ""))
    pr = event.get("pull_request")
    return {"event_name": env.get("GITHUB_EVENT_NAME", ""), "repository": env.get("GITHUB_REPOSITORY", ""),
            "workflow_ref": env.get("GITHUB_WORKFLOW_REF", ""),
            "pull_request": _pull_request_fields(pr) if isinstance(pr, dict) else None}


def _pull_request_fields(pr: dict[str, Any]) -> dict[str, Any]:
    def side(name: str) -> Any:
        part = pr.get(name)
        if not isinstance(part, dict):
            return part
        repo = part.get("repo")
        return {"sha": part.get("sha"),
                "repo": {"full_name": repo.get("full_name")} if isinstance(repo, dict) else repo}

    return {"number": pr.get("number"), "author_association": pr.get("author_association", ""),
            "head": side("head"), "base": side("base")}


def service_verdict(reported: object, repository: str, rules: RepoRules,
                    client: Callable[[], GitHubClient]) -> Verdict:
    """The guard's verdict on what a fleet runner's hook sent, for the job it reported in `repository`.
    Fails closed: anything unreadable, or GitHub not answering, refuses the job."""
    try:
        if not isinstance(reported, dict):
            raise GuardError("the runner's hook could not read the job's event")
        texts = [text for key in ("event_name", "repository", "workflow_ref")
                 if isinstance(text := reported.get(key), str) and len(text) <= 1024]
        if len(texts) != 3:
            raise GuardError("the runner's hook sent no event name, repository or workflow ref")
        event_name, event_repository, workflow_ref = texts
        if event_repository.lower() != repository.lower():
            raise GuardError(f"the event is for {event_repository[:200]!r}, not the reported job's {repository}")
        pr = reported.get("pull_request")
        job = _context(event_name, event_repository, workflow_ref, {"pull_request": pr} if pr is not None else {})
        return evaluate(job, rules, client)
    except GitHubError as exc:
        return Verdict(False, (f"the guard could not check this job ({exc}), so it refuses it.",))


def _read_event(path: str) -> dict[str, Any]:
    if not path:
        raise GuardError("GITHUB_EVENT_PATH is not set: the guard must run as the runner's job-started hook")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_EVENT_BYTES + 1)
    except OSError as exc:
        raise GuardError(f"cannot read the event file {path}: {exc.strerror}") from exc
    if len(data) > MAX_EVENT_BYTES:
        raise GuardError(f"the event file {path} is larger than {MAX_EVENT_BYTES} bytes")
    try:
        event = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GuardError(f"the event file {path} is not JSON") from exc
    if not isinstance(event, dict):
        raise GuardError(f"the event file {path} is not a JSON object")
    return event


def _pull_request(event: dict[str, Any], repository: str) -> PullRequest:
    pr = event.get("pull_request")
    if not isinstance(pr, dict):
        raise GuardError("the pull request event has no pull_request object")
    head, base = pr.get("head"), pr.get("base")
    if not isinstance(head, dict) or not isinstance(base, dict):
        raise GuardError("the pull request event lacks head or base")
    head_repo = _repo_name(head.get("repo"), allow_missing=True)
    base_repo = str(_repo_name(base.get("repo"), allow_missing=False))
    if base_repo.lower() != repository.lower():
        raise GuardError(f"the pull request's base {base_repo} is not the job's repository {repository}")
    number = pr.get("number")
    association = pr.get("author_association", "")
    fields = (head.get("sha"), base.get("sha"))
    if not all(isinstance(sha, str) and SHA_RE.match(sha) for sha in fields):
        raise GuardError("the pull request's head or base sha is missing or malformed")
    if not isinstance(number, int) or isinstance(number, bool) or not isinstance(association, str):
        raise GuardError("the pull request's number or author_association is malformed")
    return PullRequest(number, head_repo, base_repo, head["sha"], base["sha"], association.upper()[:64])


def _repo_name(repo: Any, *, allow_missing: bool) -> str | None:
    if repo is None and allow_missing:
        return None
    name = repo.get("full_name") if isinstance(repo, dict) else None
    if not isinstance(name, str) or not REPOSITORY_RE.match(name):
        raise GuardError("a repository in the pull request event is malformed")
    return name


def _workflow_path(workflow_ref: str, repository: str) -> str | None:
    """The workflow file's path, when GITHUB_WORKFLOW_REF names a workflow of this repository.

    For a reusable workflow called from another repository the path is that repository's; the
    fork check only compares files of the job's own repository, so it answers None then.
    """
    match = WORKFLOW_REF_RE.match(workflow_ref)
    if not match:
        return None
    if match["repo"].lower() != repository.lower():
        return None
    path = match["path"]
    if not SAFE_PATH_RE.match(path):
        raise GuardError(f"the workflow path {path[:255]!r} is malformed")
    return path


def evaluate(job: JobContext, rules: RepoRules, client: Callable[[], GitHubClient]) -> Verdict:
    """Every reason to refuse the job; an empty list allows it. `client` is only called when the
    job needs GitHub (a fork pull request), so most jobs need no credentials at all."""
    reasons = []
    if rules.trusted_triggers and job.event_name not in rules.trusted_triggers:
        reasons.append(
            f"{job.repository} only allows jobs triggered by {', '.join(rules.trusted_triggers)}, "
            f"and this job was triggered by {job.event_name}."
        )
    pr = job.pull_request
    if pr and rules.author_associations and pr.author_association not in rules.author_associations:
        reasons.append(
            f"{job.repository} only runs pull requests from authors who are "
            f"{', '.join(rules.author_associations)}, "
            f"and the author of #{pr.number} is {pr.author_association or 'unknown'}."
        )
    if pr and pr.from_fork and job.event_name in PR_EVENTS:
        api = _once(client)  # all checks share one client, so one installation token
        reasons.extend(_fork_workflow_reasons(job, pr, rules, api))
        reasons.extend(_protected_path_reasons(job, pr, rules.protected_paths, api))
    return Verdict(allowed=not reasons, reasons=tuple(reasons))


def _once(client: Callable[[], GitHubClient]) -> Callable[[], GitHubClient]:
    """`client`, called at most once: the first check that needs GitHub creates the client, and
    the other reuses it (each call of the CLI's factory would mint a new installation token)."""
    made: list[GitHubClient] = []

    def get() -> GitHubClient:
        if not made:
            made.append(client())
        return made[0]

    return get


def _fork_workflow_reasons(
    job: JobContext, pr: PullRequest, rules: RepoRules, client: Callable[[], GitHubClient]
) -> list[str]:
    """Why the fork's pull request may change what this job runs: its workflow or anything the
    workflow reaches differs, or something under `.github/` the rules do not let forks change."""
    source = pr.head_repo or "a deleted fork"
    if job.workflow_path is None:
        return [f"this {job.event_name} job from {source} runs a workflow the guard cannot identify."]
    rev = Revisions(client(), pr.base_repo, pr.base_sha, pr.head_sha)
    github = github_changes(rev, rules.fork_may_change)
    prefix = f"this {job.event_name} job comes from the fork {source}, and"
    reasons = [
        f"{prefix} {_describe(change, job.workflow_path, pr.number)}, so it could run anything on this host."
        for change in reached_changes(rev, job.workflow_path, github_unchanged=github.same)
    ]
    if github.refused:
        reasons.append(
            f"{prefix} pull request #{pr.number} changes {_github_paths(github.refused)}, where workflows, "
            f"actions and the scripts they run live, so forks may not change it. If these files never run "
            f"(issue templates, say), the host's guard rules may list them under fork_may_change for {job.repository}."
        )
    return reasons


def _describe(change: Change, workflow: str, number: int) -> str:
    path = change.target.path
    if change.target.kind == "action":
        what = f"the local action ./{path}, which it uses,"
    elif path == workflow:
        what = f"its workflow {path}"
    else:
        what = f"the workflow {path}, which it calls,"
    how = {
        "changed": f"was changed by pull request #{number}",
        "added": f"is new in pull request #{number}",
        "removed": f"was removed by pull request #{number}",
        "root": "is the repository's root (`uses: ./`), which every pull request changes",
        "unresolvable": "is a path the guard cannot compare (a symlink, a submodule, a '..' or a backslash)",
        "unparseable": "is YAML the guard cannot read",
        "missing": "cannot be found at the pull request's base or head",
        "too-many": f"is more than the {reach.MAX_REACHED} workflows and actions the guard follows",
        "linked": "holds a symbolic link, whose target (which the fork may have changed) the guard cannot compare",
        "escapes": "runs a file outside its own directory (`..` or an absolute path in runs.main, pre, post "
                   "or image), which the guard does not compare",
        "too-big": f"has more than {reach.MAX_ACTION_LISTINGS} directories for the guard to search for symbolic links",
    }[change.status]
    return f"{what} {how}"


def _github_paths(paths: tuple[str, ...]) -> str:
    if paths == (GITHUB_DIR,):
        return f"files under {GITHUB_DIR}/"
    return ", ".join(paths)


def _protected_path_reasons(
    job: JobContext, pr: PullRequest, paths: tuple[str, ...], client: Callable[[], GitHubClient]
) -> list[str]:
    if not paths:
        return []
    api = client()
    changed = [
        path
        for path in paths
        if entry_sha(api, pr.base_repo, path, pr.base_sha) != entry_sha(api, pr.base_repo, path, pr.head_sha)
    ]
    if not changed:
        return []
    return [
        f"this {job.event_name} job comes from the fork {pr.head_repo or 'a deleted fork'}, and pull request "
        f"#{pr.number} changes {', '.join(changed)}, which {job.repository} protects from forks."
    ]


def escape_data(text: str) -> str:
    """Workflow-command escaping, so untrusted text cannot end the line or start a new command."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def error_lines(verdict: Verdict) -> list[str]:
    return [
        f"::error title=microvm-check guard::{escape_data(reason + ' ' + HOW_TO_RUN_SAFELY)}"
        for reason in verdict.reasons
    ]
