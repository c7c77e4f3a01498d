"""The SDK reads the service's sandbox answers as the contract's records (microvm_check/contract.py), the
blocking and the asyncio client alike, against a service in this process on the stand-in engine.

A sandbox's info said the record's command text ("sandbox of operator from base") as its `template`;
it says the template now, with the TTL it was given and its state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from microvm_check import AsyncSandbox, FileEntry, Sandbox, SandboxError, SandboxInfo
from runner.sandbox.fake import FakeSandbox, FakeSandboxes, prints
from runner.sandbox.port import ExecResult
from runner.service.host.assembly import ServiceHost

LIST = "find /workspace -mindepth 1 -maxdepth 1 -printf %y %s %P\\0"


def lists(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
    return ExecResult(0, b"f 5 a.txt\0d 4096 src\0l 7 link\0", b"", 1.0, False, truncated=True)


@pytest.fixture
def host(hosts: Callable[..., ServiceHost], engine: FakeSandboxes) -> ServiceHost:
    engine.programs["hi"] = prints(b"hi\n", exit_code=3)
    engine.programs[LIST] = lists
    return hosts(sandboxes={"max_live": 2, "max_per_caller": 2})


def test_a_sandboxs_info_is_its_template_ttl_and_state(host: ServiceHost) -> None:
    with Sandbox.create(ttl_seconds=60, socket=str(host.config.socket)) as sbx:
        info = sbx.info
        assert isinstance(info, SandboxInfo) and info.id == sbx.id
        assert (info.template, info.base, info.state, info.ttl_seconds) == (
            host.config.default_template, None, "running", 60.0), info
        assert 0 < info.expires_in <= 60 and info.accel == "tcg" and info.vm_id
        again = Sandbox.connect(sbx.id, sbx.token, sbx.service)
        assert (again.info.id, again.info.template, again.info.ttl_seconds) == (sbx.id, info.template, 60.0)
        again._sender.close()


def test_the_blocking_client_reads_each_answer_as_its_record(host: ServiceHost) -> None:
    with Sandbox.create(ttl_seconds=60, socket=str(host.config.socket)) as sbx:
        result = sbx.exec(["hi"])
        assert (result.exit_code, result.stdout, result.timed_out, result.truncated) == (3, b"hi\n", False, False)
        assert {(b.dest, b.port) for b in result.blocked_egress} == {("192.0.2.7", 443), ("198.51.100.1", None)}
        assert sbx.files.list() == [FileEntry("a.txt", "file", 5), FileEntry("src", "dir", 4096),
                                    FileEntry("link", "link", 7)]
        with pytest.raises(SandboxError) as refused:
            sbx.snapshot()  # the stand-in engine makes none: the ErrorAnswer's reason, with its status
        assert refused.value.status == 400 and "offers no snapshots" in str(refused.value)
    with pytest.raises(SandboxError) as gone:
        Sandbox.connect(sbx.id, sbx.token, sbx.service)
    assert gone.value.status == 404


def test_the_asyncio_client_reads_them_alike(host: ServiceHost) -> None:
    async def drive() -> tuple[SandboxInfo, SandboxInfo, int, list[FileEntry]]:
        async with await AsyncSandbox.create(ttl_seconds=60, socket=str(host.config.socket)) as sbx:
            again = await AsyncSandbox.connect(sbx.id, sbx.token, sbx.service)
            await again._sender.close()
            return sbx.info, again.info, (await sbx.exec(["hi"])).exit_code, await sbx.files.list()

    info, again, exit_code, entries = asyncio.run(drive())
    assert info.template == again.template == host.config.default_template and info.ttl_seconds == 60.0
    assert exit_code == 3 and [e.name for e in entries] == ["a.txt", "src", "link"]


def test_connect_builds_no_path_from_what_is_not_a_sandbox_id(host: ServiceHost) -> None:
    """(Another sandbox's token is a 403: test_vm_sdk.py, as a user who is not the operator, as here.)"""
    with Sandbox.create(ttl_seconds=60, socket=str(host.config.socket)) as sbx:
        with pytest.raises(SandboxError, match="sandbox id") as refused:
            Sandbox.connect("../../v1/jobs", sbx.token, sbx.service)
        assert refused.value.status is None


def test_downloads_and_uploads_one_after_another_and_at_once_each_get_their_own_answer(
        host: ServiceHost, engine: FakeSandboxes) -> None:
    """Each call spools in a file of its own: with one name per sandbox, a download's clean-up (after its
    answer had gone) removed the next one's file, a 500 (tests/e2e/test_vm_sdk.py's takeover met it)."""
    import io
    import tarfile
    import threading

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("out.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"out"))
    engine.artifacts_tar = buffer.getvalue()
    failures: list[str] = []
    with Sandbox.create(ttl_seconds=120, socket=str(host.config.socket)) as sbx:
        def calls() -> None:
            try:
                for _ in range(25):
                    with tarfile.open(fileobj=io.BytesIO(sbx.download("*")), mode="r") as got:
                        assert [m.name for m in got] == ["out.txt"]
                    sbx.upload(buffer.getvalue(), "/workspace")
            except (SandboxError, AssertionError) as exc:
                failures.append(repr(exc))

        workers = [threading.Thread(target=calls) for _ in range(2)]  # two of the sandbox's four calls at once
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
    assert failures == []
