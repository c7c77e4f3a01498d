"""The check run's policy snippet, applied to the repository's policy, lets the same job pass in block mode,
on real VMs: an audited job reaches a fake internet's host by name; its check run (posted to GitHub's
check-runs API, faked with `responses` from the real fragments) lists the attempt and a snippet; the same
job fails under block mode with nothing allowed, and passes once the snippet is the repository's policy.
Needs root, QEMU, network namespaces and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import responses

from policy import PolicyStore, load_policy
from runner.github.checks import CheckRuns
from runner.github.client import GitHubClient, RetryPolicy
from runner.jobapi.client import JobClient
from runner.service.github.checkruns import CheckRunReporter
from tests.e2e.fake_internet import ALLOWED_HOST
from tests.e2e.test_vm_e2e_network import net_host  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.github.github_fakes import API, assert_valid_request, example, load_operations

pytestmark = pytest.mark.vm

REPOSITORY = "octo/shards"
UPDATE = ("PATCH_repos_owner_repo_check-runs_check_run_id.json", "/repos/{owner}/{repo}/check-runs/{check_run_id}",
          "patch")
NEED = "web.test:8000"
# The fake host's banner over HTTP: a request that says which name it is for, as a client under a host:
# rule must (the host's name check admits nothing else); the banner server answers every connection alike.
PROBE = textwrap.dedent(
    """
    import socket, sys
    name, port = sys.argv[1].rsplit(":", 1)
    try:
        address = socket.gethostbyname(name)
        with socket.create_connection((address, int(port)), timeout=3) as s:
            s.settimeout(3)
            s.sendall(f"GET / HTTP/1.1\\r\\nHost: {name}\\r\\n\\r\\n".encode())
            ok = s.recv(100).decode("ascii", "replace") == f"{address}:{port}"
    except OSError:
        address, ok = "-", False
    print("open" if ok else "closed", sys.argv[1], address, flush=True)
    sys.exit(0 if ok else 1)
    """
)


def _completed(mock: responses.RequestsMock, seen: int, timeout: float = 60.0) -> dict:
    """The next check run's completing PATCH (posted from the reporter's thread), validated."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for call in mock.calls[seen:]:
            if call.request.method == "PATCH" and b'"conclusion"' in call.request.body:
                return assert_valid_request(call.request.body, *UPDATE)
        time.sleep(0.2)
    raise AssertionError("no completed check run was posted")


def test_the_snippet_from_the_check_run_lets_the_job_pass_in_block_mode(net_host, vm_root: Path, tmp_path: Path) -> None:
    store = tmp_path / "policies"
    (store / "octo").mkdir(parents=True)
    repository_policy = store / "octo" / "shards.yml"
    repository_policy.write_text("version: 1\nmode: audit\nallow: []\nchecks: on\n")
    host = net_host(policy_dir=str(store))
    operations = load_operations()
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.post(f"{API}/repos/{REPOSITORY}/check-runs", json=created, status=201)
        mock.patch(f"{API}/repos/{REPOSITORY}/check-runs/{created['id']}",
                   json=example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200"))
        host.service.check_runs = CheckRunReporter(
            lambda: CheckRuns(GitHubClient(lambda: "ghs_token", retry=RetryPolicy(attempts=1))), PolicyStore(store))
        client = JobClient(socket=host.config.socket)

        def job() -> tuple[object, str, dict]:
            seen = len(mock.calls)
            job_id = submit(client, f"python3 probe.py {NEED}", files={"probe.py": PROBE.encode()},
                            repository=REPOSITORY, timeout_seconds=300)
            text = output(client, job_id).decode()
            return client.get(job_id), text, _completed(mock, seen)

        audited, text, check = job()
        assert (audited.state, audited.exit_code) == ("finished", 0), text  # audit mode lets it through
        summary = check["output"]["summary"]
        assert "audit mode" in summary and "web.test" in summary and "8000" in summary
        snippet = summary.split("```yaml\n", 1)[1].split("```", 1)[0]
        assert [(r.host, sorted(r.ports)) for r in load_policy(snippet, "snippet").rules] == [("web.test", [8000])]

        repository_policy.write_text("version: 1\nmode: block\nallow: []\nchecks: on\n")
        blocked, text, check = job()
        assert (blocked.state, blocked.exit_code) == ("finished", 1), text  # the control: block mode refuses it
        assert check["conclusion"] == "failure" and f"closed {NEED}" in text

        repository_policy.write_text(snippet + "checks: on\n")  # the maintainer adds the snippet
        passed, text, check = job()
        assert (passed.state, passed.exit_code) == ("finished", 0), text
        assert f"open {NEED} {ALLOWED_HOST}" in text
        assert passed.policy_digest == load_policy(snippet, "snippet").digest()
        assert check["conclusion"] == "success"
        host.service.check_runs.close()
