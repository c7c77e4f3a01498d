"""`microvm-check status` reads the file the fleet writes; one that is not a JSON object is refused by name."""

from __future__ import annotations

import pytest

from runner.fleet import status


def test_a_status_file_that_is_not_a_json_object_is_a_value_error(tmp_path) -> None:
    path = tmp_path / "fleet-status.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a JSON object"):
        status.load(path)


def test_a_status_file_that_is_an_object_is_loaded(tmp_path) -> None:
    path = tmp_path / "fleet-status.json"
    path.write_text('{"org": "octo-org", "runners": []}')
    assert status.load(path) == {"org": "octo-org", "runners": []}
