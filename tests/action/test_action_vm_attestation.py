"""Signed job records end to end on a real VM: the action writes the job's envelope next to its
artifacts, `microvm-check verify` passes with the service's key, and fails when one byte of an
artifact, of the payload or of the signature changes, or when the key is another service's.
Needs root, QEMU and the built `base` template: skipped locally, failing under CI=true.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.attest.keys import SigningKey
from runner.attest.statement import PREDICATE_TYPE, STATEMENT_TYPE
from runner.cli import main
from tests.action.action_harness import FORK_PR, Simulation, run_action
from tests.action.test_action_vm_e2e import RUN_TESTS, TESTS, _host, suite_inputs, template  # noqa: F401 (template: a fixture)
from tests.reference import captured

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def service(template: None) -> Iterator[object]:  # one VM job serves every check below
    yield from _host({})


@pytest.fixture(scope="module")
def signed(service, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One passing suite through the action; what it left and the service's key."""
    from runner.jobapi.client import JobClient

    root = tmp_path_factory.mktemp("signed")
    workspace = root / "workspace"
    (workspace / "tests").mkdir(parents=True)
    (workspace / "tests" / "test_sample.py").write_text(TESTS)
    (workspace / "run_tests.py").write_text(RUN_TESTS)
    (workspace / "pass-me").write_text("")
    (root / "runner-temp").mkdir()
    simulation = Simulation(workspace, root / "runner-temp", captured(FORK_PR))
    result = run_action(simulation, suite_inputs(service))
    assert result.returncode == 0, result.log
    key = root / "service.pub"
    with JobClient(socket=service.config.socket) as client:
        key.write_text(client.attestation_key())
    record = json.loads(result.outputs["result-json"])["record"]
    return {"sim": simulation, "result": result, "key": key, "record": record,
            "artifacts": simulation.workspace / "artifacts"}


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_action_writes_the_envelope_and_verify_passes(signed, service, capsys) -> None:
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    envelope = signed["artifacts"] / "microvm-check.intoto.jsonl"
    assert signed["result"].outputs["attestation"] == str(envelope)
    assert "signed job record" in signed["result"].log
    code, out = verify(capsys, str(envelope), "--key", str(signed["key"]), "--artifacts", str(signed["artifacts"]))
    assert code == 0, out
    assert "signature: good" in out and "all 1 named match" in out
    record = signed["record"]
    # the same through the service's key on its socket, and the statement as JSON
    code, out = verify(capsys, str(envelope), "--socket", service.config.socket, "--json")
    assert code == 0, out
    statement = json.loads(out)
    assert statement["_type"] == STATEMENT_TYPE and statement["predicateType"] == PREDICATE_TYPE
    assert [s["name"] for s in statement["subject"]] == ["out/report.xml"]
    predicate = statement["predicate"]
    assert predicate["job"]["id"] == record["id"] and predicate["job"]["repository"] == record["repository"]
    assert predicate["job"]["sha"] == record["sha"] and predicate["job"]["runId"] == record["run_id"]
    assert (predicate["state"], predicate["exitCode"]) == ("finished", 0)
    assert predicate["junit"] == {"tests": 2, "passed": 2, "failed": 0, "skipped": 0}
    assert predicate["policyDigest"] == record["policy_digest"]
    base = TemplateStore(StateDir.default().templates).get("base")
    assert predicate["template"] == {"name": "base", "digest": base.digest} and predicate["warmBase"] is None
    assert predicate["accelerator"] in ("kvm", "tcg")
    assert predicate["startedAt"].endswith("Z") and predicate["finishedAt"] >= predicate["startedAt"]
    assert predicate["egressAudit"]["records"] == len(record["blocked_egress"])


def test_attestation_prints_what_the_action_wrote(signed, service, capsysbinary) -> None:
    envelope = (signed["artifacts"] / "microvm-check.intoto.jsonl").read_bytes()
    capsysbinary.readouterr()
    assert main(["attestation", signed["record"]["id"], "--socket", service.config.socket]) == 0
    assert capsysbinary.readouterr().out == envelope


def _tampered(signed, tmp_path: Path, change: str) -> tuple[Path, Path]:
    """A copy of the artifacts with one byte of `change` (artifact, payload, signature) flipped."""
    copy = tmp_path / "artifacts"
    shutil.copytree(signed["artifacts"], copy)
    envelope = copy / "microvm-check.intoto.jsonl"
    if change == "artifact":
        report = copy / "out" / "report.xml"
        data = bytearray(report.read_bytes())
        data[len(data) // 2] ^= 0x01
        report.write_bytes(bytes(data))
    else:
        obj = json.loads(envelope.read_bytes())
        field = obj if change == "payload" else obj["signatures"][0]
        name = "payload" if change == "payload" else "sig"
        raw = bytearray(base64.b64decode(field[name]))
        raw[len(raw) // 2] ^= 0x01
        field[name] = base64.b64encode(bytes(raw)).decode()
        envelope.write_text(json.dumps(obj) + "\n")
    return envelope, copy


@pytest.mark.parametrize("change", ["artifact", "payload", "signature"])
def test_verify_fails_when_one_byte_changes(signed, tmp_path: Path, capsys, change: str) -> None:
    envelope, copy = _tampered(signed, tmp_path, change)
    code, out = verify(capsys, str(envelope), "--key", str(signed["key"]), "--artifacts", str(copy))
    assert code == 1, out
    assert "NOT verified" in out
    expected = "out/report.xml: sha256" if change == "artifact" else "does not verify with this key"
    assert expected in out


def test_verify_fails_with_another_services_key(signed, tmp_path: Path, capsys) -> None:
    other = SigningKey.load_or_create(tmp_path / "other" / "attestation-key.pem")
    (tmp_path / "other.pub").write_text(other.public_pem)
    envelope = signed["artifacts"] / "microvm-check.intoto.jsonl"
    code, out = verify(capsys, str(envelope), "--key", str(tmp_path / "other.pub"), "--artifacts",
                       str(signed["artifacts"]))
    assert code == 1 and "does not verify with this key" in out, out


def test_the_key_is_the_services_alone(service) -> None:
    path = service.config.attestation_key_path
    info = path.stat()
    assert info.st_mode & 0o777 == 0o600 and info.st_uid == 0


def test_a_local_run_gets_a_signed_record_too(service, signed, tmp_path: Path, monkeypatch, capsys) -> None:
    from runner.commands.localrun import LocalRun

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "data.txt").write_text("local\n")
    monkeypatch.chdir(tmp_path)
    job = LocalRun(directory=checkout, command=["mkdir -p out && cp data.txt out/"], artifacts=["out"],
                   socket=service.config.socket)
    assert job.run() == 0
    envelope = tmp_path / "artifacts" / "microvm-check.intoto.jsonl"
    code, out = verify(capsys, str(envelope), "--key", str(signed["key"]), "--artifacts", str(tmp_path / "artifacts"))
    assert code == 0 and "all 1 named match" in out and "out/data.txt" in out, out


def test_attestation_and_its_key_read_from_the_config_as_jobs_does(signed, service, tmp_path: Path,
                                                                   capsysbinary) -> None:
    config = tmp_path / "service.yml"
    config.write_text(f"socket: {service.config.socket}\nstate_dir: {service.config.state_dir}\n")
    capsysbinary.readouterr()
    assert main(["attestation", signed["record"]["id"], "--config", str(config)]) == 0
    assert capsysbinary.readouterr().out == (signed["artifacts"] / "microvm-check.intoto.jsonl").read_bytes()
    assert main(["attestation-key", "--config", str(config)]) == 0
    assert capsysbinary.readouterr().out.decode() == signed["key"].read_text()
