"""The jobs page as an operator's tool (stand-in engine; the real browser on real VMs is
test_web_browser_vm.py): result colours, command, duration, filters, paging, refresh, the job page's
numbered and timestamped log, search, tail view and downloads, and cancel with its CSRF token."""

from __future__ import annotations

import html
import re
import threading
from typing import Any

import httpx

from runner.jobapi.client import JobClient
from runner.sandbox.fake import FakeSandboxes, prints, waits
from runner.service.api import page as web
from runner.service.api.page import COOKIE
from tests.jobapi.test_restored_from import image_manifest
from tests.service.service_fakes import checkout_tar, member, spec, tar_of

TOKEN = "a-test-token-of-32-characters-xx"
COOKIES = {COOKIE: TOKEN}


def _start(hosts: Any) -> tuple[Any, JobClient, str]:
    host = hosts(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    return host, JobClient(socket=host.config.socket), f"http://{address[0]}:{address[1]}"


def _run(client: JobClient, command: str, **fields: Any) -> str:
    job = client.submit(spec(command, **fields)).id
    client.upload_checkout(job, checkout_tar())
    list(client.logs(job))
    return job


def _rows(html: str) -> list[tuple[str, str]]:
    return re.findall(r'<tr class="result-([a-z_]+)" data-job="([^"]+)">', html)


def test_the_list_shows_results_commands_and_filters_and_pages(hosts, engine: FakeSandboxes, monkeypatch) -> None:
    engine.programs.update({"ok": prints(b"fine\n"), "bad": prints(b"oops\n", 3)})
    _, client, base = _start(hosts)
    ok, bad = _run(client, "ok"), _run(client, "bad", repository="octo/other")
    page = httpx.get(base + "/ui", cookies=COOKIES).text
    assert _rows(page) == [("failure", bad), ("success", ok)]  # before: a finished exit 1 looked like a success
    assert '<code title="bad">bad</code>' in page and " s</td>" in page
    assert 'http-equiv="refresh"' not in page  # nothing active: no reload
    only = httpx.get(base + "/ui", params={"state": "failure"}, cookies=COOKIES).text
    assert _rows(only) == [("failure", bad)]
    assert _rows(httpx.get(base + "/ui", params={"repository": "octo/hello"}, cookies=COOKIES).text) == \
        [("success", ok)]
    assert _rows(httpx.get(base + "/ui", params={"state": "drop table"}, cookies=COOKIES).text) == \
        [("failure", bad), ("success", ok)]  # an unknown filter is no filter
    monkeypatch.setattr(web, "PAGE_JOBS", 1)
    first = httpx.get(base + "/ui", cookies=COOKIES).text
    assert _rows(first) == [("failure", bad)] and "page 1 of 2" in first and 'id="older" href="/ui?page=2"' in first
    second = httpx.get(base + "/ui?page=2", cookies=COOKIES).text
    assert _rows(second) == [("success", ok)] and 'id="newer"' in second


def test_the_list_refreshes_itself_while_jobs_run_and_can_pause(hosts, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["wait"] = waits(release)
    _, client, base = _start(hosts)
    job = client.submit(spec("wait")).id
    client.upload_checkout(job, checkout_tar())
    for entry in client.logs(job):
        if entry.data == b"started\n":
            break
    answer = httpx.get(base + "/ui", cookies=COOKIES)
    assert f'<meta http-equiv="refresh" content="{web.REFRESH_SECONDS}">' in answer.text
    assert "script-src 'self'" in answer.headers["Content-Security-Policy"]  # no script needed, none allowed inline
    assert 'http-equiv="refresh"' not in httpx.get(base + "/ui?refresh=0", cookies=COOKIES).text
    release.set()
    list(client.logs(job))


def test_cancel_needs_the_pages_csrf_token_and_the_same_origin(hosts, engine: FakeSandboxes) -> None:
    engine.programs["wait"] = waits()
    host, client, base = _start(hosts)
    job = client.submit(spec("wait")).id
    client.upload_checkout(job, checkout_tar())
    for entry in client.logs(job):
        if entry.data == b"started\n":
            break
    page = httpx.get(base + f"/ui/jobs/{job}", cookies=COOKIES).text
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)
    url = base + f"/ui/jobs/{job}/cancel"
    assert httpx.post(url, data={"csrf": csrf}).status_code == 401  # no cookie, no token
    assert httpx.post(url, data={"csrf": "0" * 64}, cookies=COOKIES).status_code == 403
    assert httpx.post(url, data={}, cookies=COOKIES).status_code == 403
    assert httpx.post(url, data={"csrf": csrf}, cookies=COOKIES,
                      headers={"Origin": "http://evil.example"}).status_code == 403
    assert httpx.get(url, cookies=COOKIES).status_code == 405
    assert host.service.get(job).state == "running"
    other = web.csrf_token(TOKEN, "j-another-job")
    assert httpx.post(url, data={"csrf": other}, cookies=COOKIES).status_code == 403  # bound to its job
    done = httpx.post(url, data={"csrf": csrf}, cookies=COOKIES, headers={"Origin": base})
    assert done.status_code == 303 and done.headers["Location"] == f"/ui/jobs/{job}"
    list(client.logs(job))
    assert host.service.get(job).state == "cancelled"
    assert "cancelled from the jobs page" in (host.service.get(job).error or "")


def test_the_job_page_numbers_lines_searches_tails_and_offers_downloads(hosts, engine: FakeSandboxes,
                                                                        monkeypatch) -> None:
    lines = b"".join(b"line-%d\n" % i for i in range(1, 31))
    engine.programs["many"] = prints(lines, 0)
    engine.artifacts_tar = tar_of([(member("out/report.xml"), b"<r/>")])
    engine.manifest = image_manifest()
    monkeypatch.setattr(web, "PAGE_LOG_LINES", 10)
    _, client, base = _start(hosts)
    job = _run(client, "many", artifacts=["out/report.xml"], run_id=4242, run_attempt=2)
    page = httpx.get(base + f"/ui/jobs/{job}", cookies=COOKIES).text
    restored = client.get(job).restored_from
    assert restored is not None and restored.image is not None
    assert f'<dd id="restored-from">{html.escape(restored.describe())}</dd>' in page
    shown = [int(n) for n in re.findall(r'<div class="line [a-z]+" id="L(\d+)"><a class="n" href="#L\1">', page)]
    total = int(re.search(r'data-line="(\d+)"', page).group(1))
    assert shown == list(range(total - 9, total + 1)) and total >= 30  # the tail: the last 10, numbered in all
    assert ">line-30<" in page and ">line-5<" not in page
    assert re.search(r'<time title="[^"]+ UTC">\d\d:\d\d:\d\d\.\d{3}</time>', page)
    assert "the last 10 of" in page and 'href="/ui/jobs/%s/log.txt"' % job in page
    assert 'href="https://github.com/octo/hello/actions/runs/4242/attempts/2"' in page
    hits = httpx.get(base + f"/ui/jobs/{job}", params={"q": "LINE-2"}, cookies=COOKIES).text
    found = re.findall(r'id="L\d+"><a class="n" href="#L\d+">\d+</a><time[^>]*>[^<]*</time><span class="s">'
                       r'</span><span class="t">([^<]*)</span>', hits)
    assert found == ["line-2", *(f"line-{i}" for i in range(20, 30))]  # all of the log, not the tail
    whole = httpx.get(base + f"/ui/jobs/{job}/log.txt", cookies=COOKIES)
    assert whole.status_code == 200 and whole.headers["Content-Disposition"].startswith("attachment")
    assert [line.split(" ", 2)[2] for line in whole.text.splitlines() if " stdout " in line] == \
        [f"line-{i}" for i in range(1, 31)]
    tar = httpx.get(base + f"/ui/jobs/{job}/artifacts", cookies=COOKIES)
    assert tar.status_code == 200 and tar.headers["Content-Type"] == "application/x-tar"
    assert b"<r/>" in tar.content
