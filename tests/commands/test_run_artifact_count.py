"""`microvm-check run` unpacks a job's artifacts with tarsafe's default limits (runner/commands/localrun.py):
the default of 10,000 members is what bounds a guest's file count there. A service that lets more
through (artifacts.max_count is the operator's) still gets its 10,001 files refused by `run`, what
came before the bound kept; no test passed the default before, so raising it went unnoticed."""

from __future__ import annotations

from pathlib import Path

from runner.cli import main
from runner.sandbox.fake import FakeSandboxes, prints
from tests.service.service_fakes import member, tar_of


def test_run_refuses_a_jobs_artifacts_past_ten_thousand_files(api, engine: FakeSandboxes, tmp_path: Path, monkeypatch,
                                                              capsys) -> None:
    engine.programs["make"] = prints(b"")
    engine.artifacts_tar = tar_of([(member(f"out/{n}.txt"), b"") for n in range(10_001)])
    service, _ = api(artifacts={"max_count": 20_000})
    checkout = tmp_path / "co"
    checkout.mkdir()
    (checkout / "main.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    status = main(["run", "--socket", str(service.config.socket), "--dir", str(checkout), "--artifacts", "out/*",
                   "--timeout", "60", "--", "make"])
    err = capsys.readouterr().err
    assert status == 1 and "refused its artifacts: more than 10000 entries: stopped extracting" in err, err
    assert len(list((tmp_path / "artifacts" / "out").iterdir())) == 10_000
