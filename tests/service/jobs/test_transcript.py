"""The terminal transcript of a job (issue 37): bounded like the log with a note where it was cut, shown
with the guest's bytes inert for a terminal and for HTML, its sessions in the job's record (kept by the
store, saved again after the result without counting the job twice) and on the job page."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import httpx

from runner.jobapi.client import JobClient
from runner.jobapi.contract import JobRecord, JobState
from runner.sandbox.fake import FakeSandboxes, waits
from runner.service.api import page as web
from runner.service.api.page import COOKIE
from runner.service.config.settings import LogLimits
from runner.service.jobs.joblog import TRANSCRIPT, Transcript, neutral, shown_lines
from runner.service.jobs.records import RecordStore
from tests.service.service_fakes import checkout_tar, spec

TOKEN = "a-test-token-of-32-characters-xx"
HOSTILE = (b"\x1b]52;c;cHduZWQ=\x07\x1b[31mred\x1b[0m \x1bP$q m\x1b\\\xc2\x9b6n\x1b[6n\x1b]0;title\x07"
           b"<script>alert(1)</script>\r\nnext\x1b]8;;http://evil\x1b\\link\r\n")


def _lines(job_dir: Path) -> list[tuple[int, str, str]]:
    return [(line.session, line.dir, line.text) for line in shown_lines(job_dir)]


def test_the_guests_bytes_are_inert_and_each_sessions_input_and_output_keep_to_their_lines(tmp_path: Path) -> None:
    transcript = Transcript(tmp_path, LogLimits())
    transcript.note(1, "terminal session 1 attached by root")
    for key in b"ls\r":
        transcript.write(1, "in", bytes([key]))
    transcript.write(1, "out", HOSTILE[:7])  # a sequence split between chunks is whole again before it goes
    transcript.write(1, "out", HOSTILE[7:])
    transcript.write(2, "in", b"exit\r")
    lines = _lines(tmp_path)
    assert lines == [(1, "note", "terminal session 1 attached by root"), (1, "in", "ls"),
                     (1, "out", "red <script>alert(1)</script>"), (1, "out", "nextlink"), (2, "in", "exit")]
    for _, _, text in lines:
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text) and "cHduZWQ" not in text and "title" not in text
    assert neutral("a\x1b[?1049h\x1b(0b\x1bc\x07\x00") == "ab"


def test_a_transcript_past_its_budget_is_cut_with_one_note(tmp_path: Path) -> None:
    limits = LogLimits(max_bytes=4096, max_entry_bytes=512)
    transcript = Transcript(tmp_path, limits)
    for _ in range(40):
        transcript.write(1, "out", b"x" * 300 + b"\n")
    transcript.write(2, "in", b"more\r")
    assert (tmp_path / TRANSCRIPT).stat().st_size <= limits.max_bytes
    notes = [text for _, direction, text in _lines(tmp_path) if direction == "note"]
    assert len(notes) == 1 and "reached its limit of 4096 bytes" in notes[0]
    assert all(session != 2 for session, _, _ in _lines(tmp_path))
    again = Transcript(tmp_path, limits)  # a later session (the service restarted): still nothing past the budget
    again.write(3, "out", b"y" * 3000)
    assert (tmp_path / TRANSCRIPT).stat().st_size <= limits.max_bytes


def test_a_transcript_ignores_lines_not_of_its_own_shape(tmp_path: Path) -> None:
    (tmp_path / TRANSCRIPT).write_bytes(b'{"session": "x", "dir": "out", "ts": 1, "data": "eA=="}\nnot json\n'
                                        b'{"session": 1, "dir": "sideways", "ts": 1, "data": "eA=="}\n'
                                        b'{"session": 1, "dir": "out", "ts": 1, "data": "b2s="}\n')
    assert _lines(tmp_path) == [(1, "out", "ok")]


def test_the_record_keeps_its_sessions_and_a_final_record_saved_again_is_no_news(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "jobs.db")
    heard: list[str] = []

    class Events:
        def saw(self, rec: JobRecord) -> None:
            heard.append(rec.state.value)

    store.events = Events()
    record = JobRecord(id="j1", state=JobState.RUNNING, repository="o/r", sha="a" * 40, run_id=None,
                       run_attempt=None, job_name="t")
    session = {"session": 1, "who": "root", "argv": "/bin/bash -i", "attached_at": 1.0, "ended_at": None,
               "ended": None, "bytes_in": 0, "bytes_out": 0}
    record.terminal_sessions.append(dict(session))
    store.put(record)
    record.state = JobState.FINISHED
    store.put(record)
    record.terminal_sessions[0].update(ended_at=2.0, ended="its program exited 0", bytes_in=3, bytes_out=9)
    store.put(record)
    assert heard == ["running", "finished"]
    got = store.get("j1")
    assert got is not None and got.terminal_sessions[0]["ended"] == "its program exited 0"
    assert JobRecord.from_wire(got.to_wire()).terminal_sessions == got.terminal_sessions
    old = got.to_wire()
    del old["terminal_sessions"]
    assert JobRecord.from_wire(old).terminal_sessions == []


def test_the_job_page_lists_its_sessions_and_shows_the_transcript_inert(hosts: Any, engine: FakeSandboxes,
                                                                       monkeypatch: Any) -> None:
    release = threading.Event()
    engine.programs["wait"] = waits(release)
    host = hosts(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    base = f"http://{address[0]}:{address[1]}"
    client = JobClient(socket=host.config.socket)
    job = client.submit(spec("wait")).id
    client.upload_checkout(job, checkout_tar())
    for entry in client.logs(job, follow=True):
        if entry.data == b"started\n":
            break
    cookies = {COOKIE: TOKEN}
    assert 'id="no-sessions">none attached' in httpx.get(base + f"/ui/jobs/{job}", cookies=cookies).text
    run = host.service.runs.get(job)
    transcript, number = run.terminal_attached("alice (uid 1001) <b>", ["/bin/bash", "-i"])
    transcript.write(number, "in", b"cat evil\r")
    transcript.write(number, "out", HOSTILE)
    run.terminal_ended(number, "its program exited 0", 9, len(HOSTILE))
    release.set()
    list(client.logs(job, follow=True))
    record = client.get(job)
    assert record.state == JobState.FINISHED
    assert [(s["session"], s["who"], s["ended"], s["bytes_in"]) for s in record.terminal_sessions] == \
        [(1, "alice (uid 1001) <b>", "its program exited 0", 9)]
    page = httpx.get(base + f"/ui/jobs/{job}", cookies=cookies).text
    assert "alice (uid 1001) &lt;b&gt;" in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page
    assert "\x1b" not in page and "cHduZWQ" not in page and "\x9b" not in page
    assert re.search(r'<span class="s">#1 in</span><span class="t">cat evil</span>', page)
    download = httpx.get(base + f"/ui/jobs/{job}/terminal.txt", cookies=cookies)
    assert download.status_code == 200 and download.headers["Content-Disposition"].startswith("attachment")
    assert download.headers["Content-Type"] == "text/plain; charset=utf-8"  # never rendered: no sniffing, no script
    assert download.headers["X-Content-Type-Options"] == "nosniff" and "Content-Security-Policy" in download.headers
    assert "\x1b" not in download.text and "\x07" not in download.text and "cHduZWQ" not in download.text
    assert re.search(r"#1 out  red <script>alert\(1\)</script>\n", download.text)
    monkeypatch.setattr(web, "PAGE_TRANSCRIPT_LINES", 1)
    tail = httpx.get(base + f"/ui/jobs/{job}", cookies=cookies).text
    assert re.search(r"The last 1 of \d+ lines are shown", tail)
    assert httpx.get(base + "/ui/jobs/j-nope/terminal.txt", cookies=cookies).status_code == 404


# -- review: each of neutral()'s removals on its own (each test failed on a mutation that dropped one) --


def test_a_lone_c1_control_is_removed() -> None:
    """U+0085 (NEL), U+008D (reverse index) and U+0080 are no sequence's start: the control class removes them."""
    assert neutral("a\u0085b\u008dc\u0080d") == "abcd"


def test_a_c1_string_sequence_goes_whole() -> None:
    """An 8-bit OSC (U+009D), DCS (U+0090) or APC (U+009F) string goes with its text to its terminator."""
    assert neutral("a\u009d52;c;cHduZWQ=\u0007b\u0090$q m\u009cc\u009fx\u001b\\d") == "abcd"


def test_a_note_and_a_line_left_open_at_the_end_are_neutralised_too(tmp_path: Path) -> None:
    """A note carries the attacher's argv and an error's text; a session's last output may end without a
    newline: neither reaches the page or terminal.txt with an escape sequence."""
    transcript = Transcript(tmp_path, LogLimits())
    transcript.note(1, "attached: \x1b]0;owned\x07bash \x1b[2J")
    transcript.write(1, "out", b"done\r\n\x1b]52;c;cHduZWQ=\x07\x1b[31mprompt$ ")
    assert _lines(tmp_path) == [(1, "note", "attached: bash "), (1, "out", "done"), (1, "out", "prompt$ ")]


def test_a_line_longer_than_max_line_is_shown_in_pieces(tmp_path: Path) -> None:
    from runner.service.jobs.joblog import MAX_LINE
    transcript = Transcript(tmp_path, LogLimits(max_bytes=1024 * 1024))
    transcript.write(1, "out", b"x" * MAX_LINE)
    transcript.write(1, "out", b"y\n")
    assert [text for _, _, text in _lines(tmp_path)] == ["x" * MAX_LINE, "y"]


def test_a_lone_carriage_return_ends_a_line_and_never_stays() -> None:
    """A carriage return would let the guest's next text overwrite the line shown in a terminal (cat terminal.txt)."""
    assert neutral("rm -rf /\rls") == "rm -rf /\nls" and neutral("a\r\nb") == "a\nb"
