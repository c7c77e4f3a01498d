"""The jobs page in a real browser (Debian's chromium, headless, driven by Playwright) against a real
service and a real VM: the jobs list, a running job's page whose log grows as the guest prints, a guest
that prints HTML and script shown as text, and the metrics scraped during the job checked against the
job records. Screenshots are kept under tests/output/web/ (ignored by git)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.jobapi.client import JobClient
from tests.conftest import require
from tests.e2e.vm_jobs import templates, vm_host, vm_root  # noqa: F401 (fixtures)
from tests.service.service_fakes import checkout_tar, spec

pytestmark = pytest.mark.vm
TOKEN = "browser-test-token-0123456789abcdef"
OUTPUT = Path(__file__).resolve().parents[1] / "output" / "web"
PAYLOAD = "<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">"
COMMAND = f"printf '%s\\n' '{PAYLOAD}'; for i in $(seq 1 60); do echo tick-$i; sleep 0.5; done"


def _chromium() -> str:
    path = shutil.which("chromium")
    require(path is not None, "Debian's chromium is not installed (scripts/setup installs it)")
    return path


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _ticks(page) -> int:
    return page.evaluate("() => (document.getElementById('log').textContent.match(/tick-/g) || []).length")


def test_a_running_job_in_the_browser_and_its_metrics(vm_host) -> None:
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    host = vm_host(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    base = f"http://{address[0]}:{address[1]}"
    client = JobClient(socket=host.config.socket)
    job = client.submit(spec(COMMAND)).id
    client.upload_checkout(job, checkout_tar())
    for entry in client.logs(job):
        if b"tick-1\n" in entry.data:
            break
    during = _metrics(base)
    running = [r for r in host.service.list(50) if r.state == "running"]
    assert [r.id for r in running] == [job]
    assert during[("microvm_check_jobs_active", (("state", "running"),))] == len(running)
    assert during[("microvm_check_vms_running", ())] >= 1
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/ui?token={TOKEN}")
            assert page.url == f"{base}/ui"  # the token left the address for a cookie
            assert page.locator(f'tr.result-running a[href="/ui/jobs/{job}"]').count() == 1
            page.screenshot(path=str(OUTPUT / "jobs.png"), full_page=True)
            page.click(f'tr.result-running a[href="/ui/jobs/{job}"]')
            page.wait_for_selector("#log")
            first = _ticks(page)
            page.wait_for_function(f"() => (document.getElementById('log').textContent.match(/tick-/g) || [])"
                                   f".length > {first + 2}", timeout=60_000)
            page.screenshot(path=str(OUTPUT / "job-running.png"), full_page=True)
            assert PAYLOAD in page.locator("#log").text_content()
            assert page.evaluate("() => document.querySelectorAll('#log script, #log img').length") == 0
            assert page.evaluate("() => window.pwned") is None
            page.wait_for_function("() => document.getElementById('state').textContent === 'finished'",
                                   timeout=120_000)
            assert _ticks(page) == 60 and page.locator("#exit").text_content() == "0"
            page.screenshot(path=str(OUTPUT / "job-finished.png"), full_page=True)
            assert page.evaluate("() => window.pwned") is None
        finally:
            browser.close()
    record = client.get(job)
    after = _metrics(base)
    assert (record.state, record.exit_code) == ("finished", 0)
    assert after[("microvm_check_jobs_total", (("result", "success"), ("state", "finished")))] == 1
    assert after[("microvm_check_jobs_active", (("state", "running"),))] == 0
    assert after[("microvm_check_vm_ready_seconds_count", (("warm", str(record.warm).lower()),))] == 1
    assert after[("microvm_check_vm_ready_seconds_sum", (("warm", str(record.warm).lower()),))] == \
        pytest.approx(record.timings.vm_ready_ms / 1000)
    assert after[("microvm_check_job_duration_seconds_sum", (("result", "success"),))] == \
        pytest.approx(record.timings.finished_at - record.timings.started_at)


FAILING = ("echo building; echo 'warning: deprecated' >&2; mkdir -p out; echo '<r/>' > out/report.xml; "
           "echo 'error: 2 tests failed' >&2; exit 3")


def test_the_operators_page_in_the_browser(vm_host) -> None:
    """Real VMs and the real browser: the list's result colours and filters, a failed job's page (stderr told
    apart without red, line anchors, search, artifact download, the GitHub run link), a huge log's tail view
    with the whole log as a download, and cancelling a running job with the page's button (CSRF token)."""
    from playwright.sync_api import sync_playwright

    executable = _chromium()
    host = vm_host(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    base = f"http://{address[0]}:{address[1]}"
    client = JobClient(socket=host.config.socket)

    def submit(command: str, **fields) -> str:
        job = client.submit(spec(command, **fields)).id
        client.upload_checkout(job, checkout_tar())
        return job
    failed = submit(FAILING, artifacts=["out/report.xml"], run_id=987654, run_attempt=1)
    list(client.logs(failed))
    huge = submit("seq 1 6000")
    list(client.logs(huge))
    running = submit("echo started; sleep 300")
    for entry in client.logs(running):
        if entry.data == b"started\n":
            break
    OUTPUT.mkdir(parents=True, exist_ok=True)
    violations: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
            page = context.new_page()
            page.on("console", lambda message: violations.append(message.text)
                    if "Content Security Policy" in message.text else None)
            page.goto(f"{base}/ui?token={TOKEN}")
            assert page.locator(f'tr.result-failure[data-job="{failed}"] td.exit').text_content() == "3"
            assert page.locator(f'tr.result-success[data-job="{huge}"]').count() == 1
            assert page.locator(f'tr.result-running[data-job="{running}"]').count() == 1
            assert page.locator('meta[http-equiv="refresh"]').count() == 1  # a job runs: the list reloads itself
            colours = page.evaluate("() => [...document.querySelectorAll('#jobs tbody tr td.result')]"
                                    ".map(td => getComputedStyle(td).color)")
            assert len(set(colours)) == 3, colours  # failure, success and running look different
            page.screenshot(path=str(OUTPUT / "jobs-list.png"), full_page=True)
            page.select_option("#filters select[name=state]", "failure")
            page.click("#filters button")
            page.wait_for_url("**/ui?state=failure*")
            assert [r.get_attribute("data-job") for r in page.locator("#jobs tbody tr").all()] == [failed]

            page.goto(f"{base}/ui/jobs/{failed}")
            stderr = page.locator("#log .line.stderr")
            assert stderr.count() == 2 and "warning: deprecated" in stderr.first.text_content()
            red = page.evaluate("() => { const c = getComputedStyle(document.querySelector('#log .stderr .t')).color;"
                                " const [r, g, b] = c.match(/\\d+/g).map(Number); return r > 150 && g < 120 && b < 120; }")
            assert red is False, "stderr is painted red"
            assert page.locator("#log .line.stderr .s").first.text_content() == "err"
            assert page.locator("#github-run").get_attribute("href") == \
                "https://github.com/octo/hello/actions/runs/987654/attempts/1"
            line = page.locator("#log .line.stdout").first
            anchor = line.get_attribute("id")
            line.locator("a.n").click()
            assert page.url.endswith("#" + anchor)
            assert page.evaluate("() => getComputedStyle(document.querySelector(':target')).backgroundColor") != \
                "rgba(0, 0, 0, 0)"
            assert page.locator(f"#{anchor} time").text_content().count(":") == 2
            with page.expect_download() as download:
                page.click("#download-artifacts")
            assert b"<r/>" in Path(download.value.path()).read_bytes()
            page.screenshot(path=str(OUTPUT / "job-failed.png"), full_page=True)
            page.fill("#search input[name=q]", "tests failed")
            page.click("#search button")
            page.wait_for_selector("#hits")
            assert [t.text_content() for t in page.locator("#log .line .t").all()] == ["error: 2 tests failed"]

            page.goto(f"{base}/ui/jobs/{huge}")
            assert page.locator("#log .line").count() == 2000 and page.locator("#tail-note").is_visible()
            assert page.locator("#log .line .t").last.text_content() in ("6000", "") or \
                "6000" in page.locator("#log").text_content()
            page.screenshot(path=str(OUTPUT / "job-tail.png"))
            with page.expect_download() as download:
                page.click("#download-log")
            whole = Path(download.value.path()).read_text().splitlines()
            assert [line.split(" ", 2)[2] for line in whole if " stdout " in line] == [str(i) for i in range(1, 6001)]

            page.goto(f"{base}/ui/jobs/{running}")
            page.click("#cancel button")
            page.wait_for_function("() => (document.getElementById('state') || {}).textContent === 'cancelled'",
                                   timeout=60_000)
            assert page.url == f"{base}/ui/jobs/{running}"
            page.screenshot(path=str(OUTPUT / "job-cancelled.png"), full_page=True)
        finally:
            browser.close()
    assert violations == []
    assert client.get(running).state == "cancelled"
    assert client.get(failed).exit_code == 3
