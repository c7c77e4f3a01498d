"""The error tree (runner/errors.py): every project error has one root and an area, and the CLI prints
an error of the tree as one line while anything else, a bug, keeps its traceback."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from policy.load import PolicyError
from policy.yamldoc import Problem
from runner import errors
from runner.cli import BUG, main, run_command
from runner.errors import MicrovmCheckError
from runner.service.host.assembly import ServiceHost
from tests.error_tree import exception_classes, qualified
from tests.service.service_fakes import baked_template

# Outside the tree on purpose (runner/errors.py says why): a bug, a file the guest imports alone (and the
# host's own kind-carrying subclass of its ProtocolError), signals (the action's and a local run's, both
# KeyboardInterrupt so that cleanup runs as for Ctrl-C), the name check's private "first flight cut short"
# (never leaves runner/net/namecheck.py); and, to move, CgroupError: runner/fleet/processes.py still catches
# it as the OSError it is today.
OUTSIDE = {"runner.jobapi.contract.StateTransitionError", "runner.vm.guestwire.ProtocolError",
           "runner.vm.agent._Violation", "action.__main__.Interrupted", "runner.fleet.cgroup.CgroupError",
           "runner.commands.localrun.Stopped", "runner.net.namecheck._Short"}
AREAS = [cls for cls in vars(errors).values()
         if isinstance(cls, type) and cls.__bases__ == (MicrovmCheckError,)] + [PolicyError]


def test_every_project_exception_has_the_one_root_but_those_named() -> None:
    outside = {qualified(cls) for cls in exception_classes() if not issubclass(cls, MicrovmCheckError)}
    assert outside == OUTSIDE


def test_no_project_error_passes_for_a_builtin_one() -> None:
    """An `except ValueError` meant for `int()` must not swallow a project error, nor a bug pass for one."""
    posing = [qualified(cls) for cls in exception_classes()
              if issubclass(cls, MicrovmCheckError) and issubclass(cls, (ValueError, RuntimeError, LookupError, OSError))]
    assert posing == []


def test_every_error_belongs_to_an_area() -> None:
    lost = [qualified(cls) for cls in exception_classes()
            if issubclass(cls, MicrovmCheckError) and cls is not MicrovmCheckError and cls not in AREAS
            and not any(issubclass(cls, area) for area in AREAS)]
    assert lost == []
    assert {area.__name__ for area in AREAS} == {"UserError", "ConfigError", "JobError", "ClientError", "ArchiveError",
                                                 "SandboxError", "TemplateError", "NetworkError", "GitHubError",
                                                 "AttestationError", "PolicyError"}


def _error_of(area: type[MicrovmCheckError], message: str) -> MicrovmCheckError:
    """`area`'s error with this message ("FILE: what"; a policy's problems name their file)."""
    if area is PolicyError:
        file, _, what = message.partition(": ")
        return PolicyError([Problem(file, 0, 0, what)])
    return area(message)


def _command_raising(exc: BaseException) -> argparse.Namespace:
    def command(args: argparse.Namespace) -> int:
        raise exc
    return argparse.Namespace(func=command)


@pytest.mark.parametrize("area", AREAS, ids=lambda area: area.__name__)
def test_an_areas_error_is_printed_as_one_line(area: type[MicrovmCheckError], capsys) -> None:
    message = "/etc/microvm-check/service.yml: the socket /run/x.sock is taken: stop the other service"
    assert str(_error_of(area, message)) == message
    assert run_command(_command_raising(_error_of(area, message))) == 1
    assert capsys.readouterr().err == f"microvm-check: {message}\n"


@pytest.mark.parametrize("bug", [KeyError("missing"), ValueError("invalid literal for int() with base 10: 'x'"),
                                 RuntimeError("dictionary changed size during iteration")], ids=repr)
def test_anything_else_is_a_bug_printed_with_its_traceback(bug: Exception, capsys) -> None:
    assert run_command(_command_raising(bug)) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert f"{type(bug).__name__}: {bug}\n" in err
    assert err.endswith(f"\n{BUG}\n")


@pytest.fixture
def serve_config(short_dir: Path, monkeypatch) -> Path:
    """A config `serve` accepts; its signal handlers stay out of this test process."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    path = short_dir / "service.yml"
    path.write_text(f"socket: {short_dir}/api.sock\nstate_dir: {short_dir}/state\n")
    baked_template(short_dir / "state")
    return path


def test_serve_shows_a_bug_as_a_bug(serve_config: Path, monkeypatch, capsys) -> None:
    """A ValueError from a bug while the service starts used to be printed as a one-line user error."""
    def broken(self: ServiceHost) -> ServiceHost:
        int("x")
        return self
    monkeypatch.setattr(ServiceHost, "__enter__", broken)
    assert main(["serve", "--config", str(serve_config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert "ValueError: invalid literal for int() with base 10: 'x'\n" in err and err.endswith(f"\n{BUG}\n")


@pytest.mark.parametrize("area", AREAS, ids=lambda area: area.__name__)
def test_serve_shows_an_areas_error_as_one_line(area: type[MicrovmCheckError], serve_config: Path, monkeypatch,
                                                capsys) -> None:
    def refused(self: ServiceHost) -> ServiceHost:
        raise _error_of(area, f"{serve_config}: the host cannot start like this")
    monkeypatch.setattr(ServiceHost, "__enter__", refused)
    assert main(["serve", "--config", str(serve_config)]) == 1
    assert capsys.readouterr().err == f"microvm-check: {serve_config}: the host cannot start like this\n"


def test_serve_names_the_socket_another_service_holds(serve_config: Path, short_dir: Path, capsys) -> None:
    """A real start-up refusal (not a stand-in): the API's socket is live, so serve stops with one line."""
    import socket

    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(str(short_dir / "api.sock"))
    holder.listen(1)
    try:
        assert main(["serve", "--config", str(serve_config)]) == 1
    finally:
        holder.close()
    assert capsys.readouterr().err == f"microvm-check: socket: another service already listens on {short_dir}/api.sock\n"
