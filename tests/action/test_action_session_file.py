"""The action's session-token file (action/session.py) is never read through a symlink: whatever a
step plants at RUNNER_TEMP/microvm-check-session in its place, the action does not send the file it
points at to the service as a token."""

from __future__ import annotations

from pathlib import Path

from action import session


def test_a_symlink_in_place_of_the_token_file_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere"
    secret.write_text("a-file-the-link-points-at\n")
    (tmp_path / session.FILE).symlink_to(secret)
    assert session.read({"RUNNER_TEMP": str(tmp_path)}) is None
    (tmp_path / session.FILE).unlink()
    (tmp_path / session.FILE).write_text("a-real-token\n")
    assert session.read({"RUNNER_TEMP": str(tmp_path)}) == "a-real-token"
