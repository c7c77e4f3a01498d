"""The trusted policy source: the default branch's file, cached by blob sha (the store comes first:
tests/service/jobs/test_egress.py)."""

from __future__ import annotations

import base64
import hashlib

import pytest
import responses
from responses import matchers

from policy.load import MAX_BYTES
from runner.github.client import GitHubClient
from runner.github.contents import check_path, get_file
from runner.github.errors import GitHubError, NotFound
from runner.github.policy_source import POLICY_PATH, PolicySource
from tests.github.github_fakes import API, CONTENTS_FILE, CONTENTS_OP, example, load_payload

REPO = "listendev/lstn"
CONTENTS = f"{API}/repos/{REPO}/contents/{POLICY_PATH}"
POLICY = "version: 1\nmode: block\nallow:\n  - {host: pypi.org, ports: [443]}\n"


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_answer(operations, data: bytes, path: str = POLICY_PATH) -> dict:
    """The documented file answer, carrying our bytes (base64 in 60-char lines, as GitHub sends)."""
    body = example(operations, CONTENTS_OP, "200", CONTENTS_FILE)
    encoded = base64.b64encode(data).decode()
    body.update(
        content="\n".join(encoded[i : i + 60] for i in range(0, len(encoded), 60)) + "\n",
        size=len(data), sha=blob_sha(data), name=path.rsplit("/", 1)[-1], path=path,
    )
    return body


@pytest.fixture
def client() -> GitHubClient:
    return GitHubClient(lambda: "ghs_installation_token", sleep=lambda _: None)


@pytest.fixture
def repository_answer() -> dict:
    """The repository object as GitHub sends it (taken from a real delivery of the same repository)."""
    return load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"]


@responses.activate
def test_policy_comes_from_the_default_branch(client, operations, repository_answer) -> None:
    responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    data = POLICY.encode()
    responses.get(CONTENTS, json=file_answer(operations, data), headers={"ETag": '"v1"'},
                  match=[matchers.query_param_matcher({"ref": "main"})])
    found = PolicySource(client).for_repository(REPO)
    assert found.text == POLICY
    assert (found.provenance.repository, found.provenance.ref, found.provenance.sha) == (REPO, "main", blob_sha(data))
    assert "listendev/lstn:.github/microvm-check.yml@main" in found.provenance.describe()


@responses.activate
def test_unchanged_file_is_revalidated_by_etag_and_served_from_cache(client, operations, repository_answer) -> None:
    repo_call = responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    data = POLICY.encode()
    responses.get(CONTENTS, body=b"", headers={"ETag": '"v1"'},
                  match=[matchers.header_matcher({"If-None-Match": '"v1"'}, strict_match=False)], status=304)
    first = responses.get(CONTENTS, json=file_answer(operations, data), headers={"ETag": '"v1"'})
    source = PolicySource(client)
    one = source.for_repository(REPO)
    two = source.for_repository(REPO)
    assert one == two
    assert first.call_count == 1 and repo_call.call_count == 1
    assert responses.calls[-1].response.status_code == 304


@responses.activate
def test_changed_file_is_read_again(client, operations, repository_answer) -> None:
    responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    responses.get(CONTENTS, json=file_answer(operations, POLICY.encode()), headers={"ETag": '"v1"'})
    source = PolicySource(client)
    assert source.for_repository(REPO).text == POLICY
    responses.replace(responses.GET, CONTENTS, json=file_answer(operations, b"version: 1\nmode: audit\n"),
                      headers={"ETag": '"v2"'})
    changed = source.for_repository(REPO)
    assert changed.text == "version: 1\nmode: audit\n"
    assert changed.provenance.sha == blob_sha(b"version: 1\nmode: audit\n")


@responses.activate
def test_no_policy_file_means_none(client, repository_answer) -> None:
    responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    responses.get(CONTENTS, status=404, json={"message": "Not Found"})
    assert PolicySource(client).for_repository(REPO) is None


@responses.activate
def test_invisible_repository_is_explained(client) -> None:
    responses.get(f"{API}/repos/{REPO}", status=404, json={"message": "Not Found"})
    with pytest.raises(NotFound, match="install the App"):
        PolicySource(client).for_repository(REPO)


@pytest.mark.parametrize(
    "name",
    ["listendev", "a/b/c", "../etc/passwd", "../..", "owner/..", ".x/repo", "owner/repo\n", "owner/repo?ref=x", ""],
)
def test_malformed_repository_names_are_refused(client, name) -> None:
    with pytest.raises(GitHubError, match="owner/repo"):
        PolicySource(client).for_repository(name)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda body: body.update(content="", encoding="none"), "too large"),
        (lambda body: body.update(content=base64.b64encode(b"\xff\xfe").decode(), size=2), "not UTF-8"),
        (lambda body: body.update(size=3), "announced"),
        (lambda body: body.update(type="symlink"), "not a file"),
        (lambda body: body.update(sha="not-a-sha"), "sha"),
    ],
)
@responses.activate
def test_unusable_files_are_refused(client, operations, repository_answer, mutate, message) -> None:
    responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    body = file_answer(operations, POLICY.encode())
    mutate(body)
    responses.get(CONTENTS, json=body)
    with pytest.raises(GitHubError, match=message):
        PolicySource(client).for_repository(REPO)


@responses.activate
def test_oversize_policy_is_refused(client, operations, repository_answer) -> None:
    responses.get(f"{API}/repos/{REPO}", json=repository_answer)
    responses.get(CONTENTS, json=file_answer(operations, b"#" * (MAX_BYTES + 1)))
    with pytest.raises(GitHubError, match="at most"):
        PolicySource(client).for_repository(REPO)


@responses.activate
def test_directory_answer_is_refused(client, operations) -> None:
    listing = example(operations, CONTENTS_OP, "200", "application/json:response-if-content-is-a-directory")
    responses.get(f"{API}/repos/{REPO}/contents/lib", json=listing)
    with pytest.raises(GitHubError, match="not a file"):
        get_file(client, REPO, "lib", "main")


@responses.activate
def test_documented_file_example_parses(client, operations) -> None:
    """The example as documented: its metadata parses; its content has a known upstream flaw (the
    line breaks are the two characters backslash and n), which the strict decoder refuses; with real
    line breaks, as GitHub sends them, it decodes to the README it claims to be."""
    documented = example(operations, CONTENTS_OP, "200", CONTENTS_FILE)
    responses.get(f"{API}/repos/octokit/octokit.rb/contents/README.md", json=documented)
    meta = get_file(client, "octokit/octokit.rb", "README.md", "master", decode=False)
    assert (meta.sha, meta.size, meta.content) == ("3d21ec53a331a6f037a91c368710b99387d012c1", 5362, None)
    with pytest.raises(GitHubError, match="invalid base64"):
        get_file(client, "octokit/octokit.rb", "README.md", "master")
    from runner.github.contents import _decode

    fixed = dict(documented, content=documented["content"].replace("\\n", "\n"))
    with pytest.raises(GitHubError, match="announced 5362"):  # the example's content is truncated
        _decode(fixed, "README.md")
    assert base64.b64decode("".join(fixed["content"].split())).startswith(b"# Yoga Bo")


@pytest.mark.parametrize("path", ["../x", "a/../b", "/etc/passwd", "a/./b", ".", "a\nb", ""])
def test_paths_that_could_escape_are_refused(path) -> None:
    with pytest.raises(GitHubError, match="refusing repository path"):
        check_path(path)


@pytest.mark.parametrize("path", [".github/microvm-check.yml", ".github/workflows/ci.yml", "a..b/c"])
def test_ordinary_paths_pass(path) -> None:
    assert check_path(path) == path
