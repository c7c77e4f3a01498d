"""The metrics and the read-only page on the job API's TCP listener (stand-in engine; the browser and
real-VM test is test_web_browser_vm.py)."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runner.github.signature import sign
from runner.jobapi.client import JobClient
from runner.sandbox.fake import FakeSandboxes, prints, waits
from runner.service.api.metrics import result_of
from runner.service.api.page import COOKIE
from tests.reference import captured_path
from tests.service.service_fakes import checkout_tar, spec

TOKEN = "a-test-token-of-32-characters-xx"
GUEST_HTML = b"<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">\n::set-output name=x::y\n"


def _start(hosts: Any, **settings: Any) -> tuple[Any, JobClient, str]:
    host = hosts(listen="127.0.0.1:0", token=TOKEN, **settings)
    address = host.api.tcp_address
    return host, JobClient(socket=host.config.socket), f"http://{address[0]}:{address[1]}"


def _run(client: JobClient, command: str) -> str:
    job = client.submit(spec(command)).id
    client.upload_checkout(job, checkout_tar())
    return job


def _scrape(base: str) -> dict[tuple[str, tuple], float]:
    answer = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(answer.text) for s in family.samples}


def test_metrics_during_and_after_jobs_agree_with_the_records(hosts, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs.update({"ok": prints(b"fine\n"), "bad": prints(b"oops\n", 3), "wait": waits(release)})
    host, client, base = _start(hosts)
    done = [_run(client, "ok"), _run(client, "bad")]
    for job in done:
        list(client.logs(job))
    running = _run(client, "wait")
    for entry in client.logs(running):
        if entry.data == b"started\n":
            break
    during = _scrape(base)
    records = host.service.list(50)
    assert during[("microvm_check_jobs_active", (("state", "running"),))] == 1 == \
        sum(r.state == "running" for r in records)
    for rec in (r for r in records if r.final):
        key = ("microvm_check_jobs_total", (("result", result_of(rec.state, rec.exit_code)), ("state", rec.state)))
        assert during[key] == 1, key
    assert during[("microvm_check_job_duration_seconds_count", (("result", "success"),))] == 1
    assert during[("microvm_check_job_duration_seconds_count", (("result", "failure"),))] == 1
    blocked = sum(b.count for r in records for b in r.blocked_egress)
    assert blocked == 6 and during[("microvm_check_blocked_egress_attempts_total", (("reason", "policy"),))] == blocked
    release.set()
    list(client.logs(running))
    after = _scrape(base)
    assert after[("microvm_check_jobs_active", (("state", "running"),))] == 0
    assert after[("microvm_check_jobs_total", (("result", "success"), ("state", "finished")))] == 2
    assert after[("microvm_check_vm_ready_seconds_count", (("warm", "false"),))] == 3


def test_metrics_need_the_token_and_two_services_keep_their_own_counts(hosts, engine: FakeSandboxes, short_dir) -> None:
    engine.programs["ok"] = prints(b"fine\n")
    _, client_a, base_a = _start(hosts)
    _, _, base_b = _start(hosts, socket=str(short_dir / "b.sock"), state_dir=str(short_dir / "b"))
    list(client_a.logs(_run(client_a, "ok")))
    assert httpx.get(base_a + "/metrics").status_code == 401
    assert httpx.get(base_a + "/metrics", cookies={COOKIE: TOKEN}).status_code == 401  # the cookie is the page's only
    assert _scrape(base_a)[("microvm_check_jobs_total", (("result", "success"), ("state", "finished")))] == 1
    assert ("microvm_check_jobs_total", (("result", "success"), ("state", "finished"))) not in _scrape(base_b)


def test_a_token_in_the_address_becomes_a_strict_cookie_and_leaves_the_address(hosts) -> None:
    _, _, base = _start(hosts)
    assert httpx.get(base + "/ui").status_code == 401
    assert httpx.get(base + "/ui?token=wrong-token-wrong-token").status_code == 401
    answer = httpx.get(base + f"/ui/insights?repository=o%2Fr&token={TOKEN}")
    assert answer.status_code == 303 and answer.headers["Location"] == "/ui/insights?repository=o%2Fr"
    cookie = answer.headers["Set-Cookie"]
    assert cookie == f"{COOKIE}={TOKEN}; Path=/ui; HttpOnly; SameSite=Strict"
    page = httpx.get(base + "/ui", cookies={COOKIE: TOKEN})
    assert page.status_code == 200 and "<h1>Jobs</h1>" in page.text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    # the cookie reaches nothing that changes state, nor the job API
    assert httpx.post(base + "/ui", cookies={COOKIE: TOKEN}).status_code == 401
    assert httpx.get(base + "/v1/jobs", cookies={COOKIE: TOKEN}).status_code == 401
    assert httpx.post(base + "/ui", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 405


def test_guest_html_is_text_on_the_job_page_and_the_log_stream_is_neutralised(hosts, engine: FakeSandboxes) -> None:
    engine.programs["html"] = prints(GUEST_HTML, 0)
    _, client, base = _start(hosts)
    job = _run(client, "html")
    list(client.logs(job))
    cookies = {COOKIE: TOKEN}
    page = httpx.get(base + f"/ui/jobs/{job}", cookies=cookies).text
    assert "<script>window" not in page and "<img src=x" not in page
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;&lt;img src=x onerror=" in page
    assert "\u200b::set-output name=x::y" in page
    assert page.count("<script") == 1 and '<script src="/ui/static/log.js"></script>' in page
    lines = [json.loads(line) for line in httpx.get(base + f"/ui/jobs/{job}/logs", cookies=cookies).text.splitlines()]
    text = b"".join(base64.b64decode(line["data"]) for line in lines if "data" in line and line["stream"] == "stdout")
    assert text.decode() == GUEST_HTML.decode().replace("::set-output", "\u200b::set-output")
    assert lines[-1]["end"] is True and lines[-1]["job"]["exit_code"] == 0
    jobs = httpx.get(base + "/ui", cookies=cookies).text
    assert f'href="/ui/jobs/{job}"' in jobs
    assert httpx.get(base + "/ui/static/log.js", cookies=cookies).headers["Content-Type"].startswith("text/javascript")
    assert httpx.get(base + "/ui/static/..%2Fweb.py", cookies=cookies).status_code == 404


def test_insights_merge_the_repository_s_runs(hosts, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"fine\n")
    _, client, base = _start(hosts)
    for _ in range(2):
        list(client.logs(_run(client, "ok")))
    page = httpx.get(base + "/ui/insights", params={"repository": spec("ok")["repository"]},
                     cookies={COOKIE: TOKEN}).text
    assert "2 jobs of" in page and "mode: block" in page and "seen in 2 of 2 jobs" in page


QUEUED = "github-aws-runners.workflow_job.queued.self-hosted.json"
WEBHOOK_SECRET = b"webhook-test-secret"


def _post(url: str, body: bytes, event: str, signature: str | None) -> int:
    headers = {"Content-Type": "application/json", "X-GitHub-Event": event, "X-GitHub-Delivery": "d-1"}
    if signature is not None:
        headers["X-Hub-Signature-256"] = signature
    return httpx.post(url, content=body, headers=headers, timeout=30).status_code


def test_webhook_deliveries_are_counted_by_event_and_result(hosts, engine: FakeSandboxes,
                                                            tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(WEBHOOK_SECRET + b"\n")
    host, _, base = _start(hosts, webhook={"listen": "127.0.0.1:0", "secret_path": str(secret),
                                           "labels": ["microvm"]})
    url = f"http://127.0.0.1:{host.webhook.port}/github/webhook"
    body = captured_path(QUEUED).read_bytes()
    assert _post(url, body, "workflow_job", sign(WEBHOOK_SECRET, body)) == 200  # a job on our labels: prewarmed
    assert _post(url, body, "workflow_job", sign(WEBHOOK_SECRET, body)) == 200  # the same delivery again
    assert _post(url, body, "workflow_job", sign(b"not the secret", body)) == 403
    assert _post(url, body, "workflow_job", None) == 403  # refused on its head, before the body is read
    assert _post(url, body, "x" * 40, sign(b"not the secret", body)) == 403  # an unsigned name is no label
    metrics = _scrape(base)
    deliveries = {dict(labels)["event"] + "/" + dict(labels)["result"]: value
                  for (name, labels), value in metrics.items() if name == "microvm_check_webhook_deliveries_total"}
    assert deliveries == {"workflow_job/accepted": 1, "workflow_job/duplicate": 1, "workflow_job/bad_signature": 2,
                          "other/bad_signature": 1}
    assert ("microvm_check_guest_protocol_errors_total", (("kind", "frame"),)) not in metrics  # no engine here


def test_no_created_series_a_build_info_and_requests_by_route_and_status(hosts, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"fine\n")
    _, client, base = _start(hosts)
    job = _run(client, "ok")
    list(client.logs(job))
    client.get(job)
    httpx.get(base + "/v1/jobs/nosuchjob", headers={"Authorization": f"Bearer {TOKEN}"})
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "_created" not in text
    samples = _scrape(base)
    (info,) = [labels for (name, labels) in samples if name == "microvm_check_build_info"]
    assert dict(info)["version"] and samples[("microvm_check_build_info", info)] == 1
    requests = {labels: value for (name, labels), value in samples.items()
                if name == "microvm_check_api_request_duration_seconds_count"}

    def count(listener: str, route: str, method: str, status: str) -> float:
        return requests.get((("listener", listener), ("method", method), ("route", route), ("status", status)), 0)
    assert count("unix", "/v1/jobs", "POST", "201") == 1
    assert count("unix", "/v1/jobs/{id}/checkout", "PUT", "202") == 1
    assert count("unix", "/v1/jobs/{id}/logs", "GET", "200") == 1
    assert count("unix", "/v1/jobs/{id}", "GET", "200") == 1
    assert count("tcp", "/v1/jobs/{id}", "GET", "404") == 1
    assert count("tcp", "/metrics", "GET", "200") >= 1
    assert not any("nosuchjob" in str(labels) or job in str(labels) for labels in requests)


def test_runner_starts_and_ends_are_counted_by_whether_they_had_a_job(hosts) -> None:
    from runner.service.api.metrics import CountedRunners

    host, _, base = _start(hosts)
    counted = CountedRunners(host.desk, host.metrics)
    counted.add_runner("mvc-a", "runner-token-of-the-test-aaaaaaaa")
    counted.add_runner("mvc-b", "runner-token-of-the-test-bbbbbbbb")
    counted.remove_runner("mvc-a")
    samples = _scrape(base)
    assert samples[("microvm_check_runners_started_total", ())] == 2
    assert samples[("microvm_check_runners_ended_total", (("had_job", "false"),))] == 1
    assert counted.runner_job("mvc-b") is None and host.desk.runner_job("mvc-a") is None


def test_the_name_checks_refusals_by_name_method_and_path_on_the_metrics_and_the_job_page(
        hosts, engine: FakeSandboxes, monkeypatch) -> None:
    from policy.suggest import AuditRecord
    from runner.service.api import metrics
    from runner.service.api.page import COOKIE

    refused = [AuditRecord("203.0.113.40", 443, "tcp", "collector.evil.test", 3, "name-refused"),
               AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 2, "request-refused", "POST", "/legacy/*"),
               AuditRecord("203.0.113.41", 22, "tcp", None, 1, "unnamed", unnamed=True),
               AuditRecord("203.0.113.42", 443, "tcp", "bad.test", 1, "block-listed")]
    monkeypatch.setattr(engine, "blocked", refused)
    monkeypatch.setattr(metrics, "MAX_NAMED_SERIES", 4)
    engine.programs["ok"] = prints(b"")
    _, client, base = _start(hosts)
    job = _run(client, "ok")
    list(client.logs(job))

    scraped = _scrape(base)
    named = {labels: value for (name, labels), value in scraped.items()
             if name == "microvm_check_blocked_egress_named_attempts_total"}
    assert named == {
        (("method", ""), ("name", "collector.evil.test"), ("path", ""), ("reason", "name-refused")): 3,
        (("method", "POST"), ("name", "pypi.org"), ("path", "/legacy/*"), ("reason", "request-refused")): 2,
        (("method", ""), ("name", ""), ("path", ""), ("reason", "unnamed")): 1,
        (("method", ""), ("name", "bad.test"), ("path", ""), ("reason", "block-listed")): 1}
    refused[0] = AuditRecord("203.0.113.40", 443, "tcp", "other.evil.test", 1, "name-refused")
    list(client.logs(_run(client, "ok")))
    assert _scrape(base)[("microvm_check_blocked_egress_named_attempts_total",
                          (("method", ""), ("name", "(other)"), ("path", ""), ("reason", "name-refused")))] == 1
    page = httpx.get(base + f"/ui/jobs/{job}", cookies={COOKIE: TOKEN}).text
    assert "<td>collector.evil.test</td><td></td><td>3</td><td>name-refused</td>" in page
    assert "<td>pypi.org</td><td>POST /legacy/*</td><td>2</td><td>request-refused</td>" in page
