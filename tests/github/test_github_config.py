"""github.yml is read like the service config: unknown keys refused, aliases refused, every problem at once,
each with its file:line:col (or the environment variable it came from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.github.config import load_settings
from runner.github.errors import GitHubError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "github.yml"
    path.write_text(text)
    return path


def test_an_unknown_key_is_refused_with_its_line(tmp_path: Path) -> None:
    """Before, `instalation_id` was silently ignored and the App used no installation id at all."""
    path = write(tmp_path, "app_id: 7\nprivate_key_path: /k.pem\ninstalation_id: 42\n")
    with pytest.raises(GitHubError) as err:
        load_settings(path, env={})
    assert str(err.value) == (f"{path}:3:1: unknown key 'instalation_id' in the GitHub config; "
                              "did you mean 'installation_id'?")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "app_id: abc\ninstallation_id: 99999999999999999999\nlabels: [ok, [nested]]\n")
    with pytest.raises(GitHubError) as err:
        load_settings(path, env={"MICROVM_CHECK_GITHUB_ORG": "o\0rg"})
    assert str(err.value).splitlines() == [
        f"{path}:1:9: app_id: must be a positive whole number, not 'abc'",
        f"{path}:2:18: installation_id: must be a positive whole number, not '99999999999999999999'",
        f"{path}:3:9: labels: expected a non-empty list of at most 64 label names, not a list",
        f"{path}: private_key_path is not set in {path} (nor in the environment, which sets "
        "MICROVM_CHECK_GITHUB_ORG): point it at the App's private key (.pem)",
        f"{path}: MICROVM_CHECK_GITHUB_ORG: expected a non-empty string of at most 4096 characters without NUL, "
        "not 'o\\x00rg'",
    ]


def test_aliases_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "app_id: 7\nprivate_key_path: &k /k.pem\napp_slug: *k\n")
    with pytest.raises(GitHubError, match=r"github.yml:3:11: YAML aliases \(\*name\) are not allowed in a GitHub "
                                          r"config; write the entry out in full"):
        load_settings(path, env={})


def test_a_good_file_with_environment_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "client_id: Iv1.abc\nprivate_key_path: /k.pem\nlabels: [microvm, gpu]\n")
    settings = load_settings(path, env={"MICROVM_CHECK_GITHUB_APP_ID": "12"})
    assert (settings.client_id, settings.app_id, settings.labels, settings.private_key_path) == (
        "Iv1.abc", 12, ("microvm", "gpu"), Path("/k.pem"))


def test_a_missing_setting_names_only_the_file_that_was_read(tmp_path: Path) -> None:
    path = write(tmp_path, "app_id: 7\n")
    with pytest.raises(GitHubError) as err:
        load_settings(path, env={})
    assert str(err.value) == f"{path}: private_key_path is not set in {path}: point it at the App's private key (.pem)"


def test_settings_from_the_environment_alone_do_not_blame_a_file_that_does_not_exist(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = tmp_path / "github.yml"
    monkeypatch.setattr("runner.github.config.DEFAULT_CONFIG_PATH", absent)
    with pytest.raises(GitHubError) as err:
        load_settings(env={"MICROVM_CHECK_GITHUB_APP_ID": "7"})
    assert str(err.value) == (f"environment: private_key_path is not set in the environment (it sets "
                              f"MICROVM_CHECK_GITHUB_APP_ID; {absent} does not exist): point it at the App's "
                              "private key (.pem)")
    with pytest.raises(GitHubError) as err:
        load_settings(env={})
    assert str(err.value) == (f"no GitHub App settings: {absent} does not exist; create it with the App's client_id "
                              "(or app_id) and private_key_path (see the README, 'Register with an organisation')")


def test_a_missing_file_is_blamed_on_whatever_named_it(tmp_path: Path) -> None:
    absent = tmp_path / "absent.yml"
    with pytest.raises(GitHubError) as err:
        load_settings(absent, env={"MICROVM_CHECK_GITHUB_CONFIG": str(tmp_path / "other.yml")})
    assert str(err.value) == (f"GitHub config {absent} does not exist: create it, or name the file that holds the "
                              "GitHub App's settings")
    with pytest.raises(GitHubError) as err:
        load_settings(env={"MICROVM_CHECK_GITHUB_CONFIG": str(absent)})
    assert str(err.value) == (f"GitHub config {absent} (named by MICROVM_CHECK_GITHUB_CONFIG) does not exist: "
                              "create it or fix MICROVM_CHECK_GITHUB_CONFIG")
