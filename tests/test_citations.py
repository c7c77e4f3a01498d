"""Every file path, dotted name and `Class.member` that the docs (docs/*.md, README.md) and the comments and
docstrings of runner/, policy/, vmimages/, action/ and microvm_check/ cite resolves (the rules: tests/citations.py).
A file moved or a method renamed leaves its citations naming nothing; this names each one."""

from __future__ import annotations

from pathlib import Path

from tests import citations


def test_every_citation_in_the_docs_and_the_codes_words_resolves() -> None:
    count, bad = citations.broken(citations.texts())
    assert count > 500, f"only {count} citations read: is the scan still reading the docs and the code?"
    assert not bad, f"{len(bad)} of {count} citations do not resolve:\n" + "\n".join(bad)


def test_a_planted_bad_citation_of_each_kind_is_named_and_good_ones_are_not() -> None:
    doc = citations.ROOT / "docs" / "planted.md"
    text = "\n".join([
        "Good: `runner/service/jobs/job.py`, runner/vm/engine.py:1, `parts.py`,",
        "`runner.service.jobs.templatechoice.choose_template`, `Engine.create`, `Path.open`, /run/x/gone.py,",
        "https://example.com/a/gone.py, `setup.py`.",
        "Bad: runner/service/host.py, `runner/service/jobs/job.py:999999`, `host_jobs.py`,",
        "`runner.service.jobs.templatechoice.choose_nothing`, `runner.service.web`, `Engine.restore_all`.",
    ])
    count, bad = citations.broken([(doc, 1, text)])
    assert count == 13
    assert [line.split(": ", 1)[1] for line in bad] == [
        "runner/service/host.py (no such file)",
        "runner/service/jobs/job.py:999999 (runner/service/jobs/job.py has "
        f"{len((citations.ROOT / 'runner/service/jobs/job.py').read_text().splitlines())} lines)",
        "host_jobs.py (no such file)",
        "runner.service.jobs.templatechoice.choose_nothing (runner.service.jobs.templatechoice has no choose_nothing)",
        "runner.service.web (runner.service has no web)",
        "Engine.restore_all (no class Engine has restore_all)",
    ]
    assert all(line.startswith("docs/planted.md:4: ") or line.startswith("docs/planted.md:5: ") for line in bad)


def test_a_bare_file_name_in_the_code_resolves_within_its_own_package() -> None:
    code = citations.ROOT / "runner" / "service" / "jobs" / "planted.py"
    source = '"""See workers.py and api/paths.py (from the wing above), and engine.py, not ours here."""\n# and job.py\n'
    count, bad = citations.broken(citations.prose(code, source))
    assert count == 4
    assert [line.split(": ", 1)[1] for line in bad] == []  # runner/vm/engine.py is under runner/, one of its folders
    elsewhere = Path(citations.ROOT / "policy" / "planted.py")
    _, bad = citations.broken(citations.prose(elsewhere, '"""Read workers.py."""\n'))
    assert bad == ["policy/planted.py:1: workers.py (no such file)"]


def test_a_yaml_files_comments_are_read_and_its_values_are_not() -> None:
    path = citations.ROOT / "examples" / "planted.yml"
    source = "# see runner/gone.py\nimage: x/y.py#not-a-comment  # and tests/gone_too.py\nrun: ./a.sh\n"
    count, bad = citations.broken(citations.yaml_comments(path, source))
    assert count == 2
    assert [line.split(": ", 1)[1] for line in bad] == ["runner/gone.py (no such file)", "tests/gone_too.py (no such file)"]
