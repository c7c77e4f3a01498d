"""vmimages.oci.config: the env, workdir and user a template keeps from an image config, validated."""

from __future__ import annotations

import json

import pytest

from runner.errors import ImageError
from vmimages.oci import ImageConfig, parse_config


def config(**fields) -> bytes:
    doc = {"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": []}}
    doc["config"] = fields.pop("config", {})
    doc.update(fields)
    return json.dumps(doc).encode()


def test_env_workdir_and_user_are_kept_and_go_to_the_guest_as_json() -> None:
    got = parse_config(config(config={"Env": ["PATH=/usr/local/bin:/usr/bin", "NODE_VERSION=22.1", "EMPTY="],
                                      "WorkingDir": "/app", "User": "node", "Entrypoint": ["/bin/sh"]}), "config x")
    assert got == ImageConfig(("PATH=/usr/local/bin:/usr/bin", "NODE_VERSION=22.1", "EMPTY="), "/app", "node")
    assert got.to_json() == {"env": ["PATH=/usr/local/bin:/usr/bin", "NODE_VERSION=22.1", "EMPTY="],
                             "workdir": "/app", "user": "node"}
    assert ImageConfig.from_json(json.loads(json.dumps(got.to_json()))) == got


def test_a_config_without_config_section_is_empty() -> None:
    assert parse_config(config(config=None), "c") == ImageConfig()
    assert parse_config(b'{"os": "linux", "architecture": "amd64"}', "c") == ImageConfig()


@pytest.mark.parametrize("user", ["", "root", "1000", "1000:1000", "node:staff", "_apt"])
def test_user_forms(user) -> None:
    assert parse_config(config(config={"User": user}), "c").user == user


@pytest.mark.parametrize("doc, says", [
    (config(architecture="arm64"), "is for linux/arm64"),
    (config(os="windows"), "is for windows/amd64"),
    (config(config={"Env": ["NO_EQUALS"]}), "not NAME=value"),
    (config(config={"Env": ["1BAD=x"]}), "not NAME=value"),
    (config(config={"Env": "PATH=/bin"}), "Env must be a list"),
    (config(config={"Env": ["A=x"] * 2000}), "at most 1024"),
    (config(config={"WorkingDir": "relative"}), "WorkingDir"),
    (config(config={"WorkingDir": "/a\nb"}), "WorkingDir"),
    (config(config={"User": "a b"}), "User"),
    (config(config={"User": "1:2:3"}), "User"),
    (b'{"os": "linux", "os": "linux", "architecture": "amd64"}', "appears twice"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    (b"\xff", "not valid JSON"),
    (b"[]", "not a JSON object"),
])
def test_bad_configs_are_refused_naming_the_blob(doc, says) -> None:
    with pytest.raises(ImageError, match=says) as caught:
        parse_config(doc, "config sha256:abc")
    assert str(caught.value).startswith("config sha256:abc")


def test_from_json_checks_again() -> None:
    with pytest.raises(ImageError):
        ImageConfig.from_json({"env": ["bad"], "workdir": "", "user": ""})
    with pytest.raises(ImageError):
        ImageConfig.from_json({"env": []})
