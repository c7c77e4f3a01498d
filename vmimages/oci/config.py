"""What of an OCI image's config a template keeps: the environment, working directory and user its
commands run with. Everything else in the config (entrypoint, labels, history, exposed ports) is left out:
a job runs its own commands, and nothing of the config is ever run on the host."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runner.errors import ImageError

MAX_ENV = 1024  # entries
MAX_ENV_BYTES = 128 * 1024  # all of them together (Linux's argument+environment page budget is larger)
MAX_FIELD = 4096
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# "", name, uid, name:group, uid:gid (the runtime spec's forms; names as Debian's adduser allows them)
_USER_PART = re.compile(r"[0-9]{1,10}|[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")


@dataclass(frozen=True)
class ImageConfig:
    """The image's process settings: `env` ("K=V" each, in order), `workdir` (absolute or ""), `user`
    ("" for root, a name, uid or uid:gid), and the platform the config says it was built for."""

    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    os: str = "linux"
    architecture: str = "amd64"

    def to_json(self) -> dict[str, Any]:
        """What the template manifest records and the guest agent applies to every command."""
        return {"env": list(self.env), "workdir": self.workdir, "user": self.user}

    @classmethod
    def from_json(cls, data: object) -> ImageConfig:
        """Back from `to_json` (a template manifest on disk), checked again."""
        if not isinstance(data, dict) or set(data) != {"env", "workdir", "user"}:
            raise ImageError("an image config record must be {\"env\": [...], \"workdir\": ..., \"user\": ...}")
        return _checked("the template's image config", data["env"], data["workdir"], data["user"], "linux", "amd64")


def parse_config(raw: bytes, what: str) -> ImageConfig:
    """The OCI image config JSON `raw` (already bounded in size by its reader), validated; `what` names the
    blob in errors. Only linux/amd64 images are accepted: the VMs are x86-64 Linux."""
    doc = load_json(raw, what)
    if not isinstance(doc, dict):
        raise ImageError(f"{what}: the image config is not a JSON object")
    os_name, arch = doc.get("os"), doc.get("architecture")
    if os_name != "linux" or arch != "amd64":
        raise ImageError(f"{what}: the image is for {str(os_name)[:40]}/{str(arch)[:40]}, and templates run "
                         "linux/amd64: use the image's linux/amd64 variant")
    config = doc.get("config") or {}
    if not isinstance(config, dict):
        raise ImageError(f"{what}: the image config's \"config\" is not an object")
    return _checked(what, config.get("Env") or [], config.get("WorkingDir") or "", config.get("User") or "",
                    os_name, arch)


def _checked(what: str, env: object, workdir: object, user: object, os_name: str, arch: str) -> ImageConfig:
    if not isinstance(env, list) or len(env) > MAX_ENV or not all(isinstance(e, str) for e in env):
        raise ImageError(f"{what}: Env must be a list of at most {MAX_ENV} strings")
    if sum(len(e) for e in env) > MAX_ENV_BYTES:
        raise ImageError(f"{what}: Env is longer than {MAX_ENV_BYTES} characters in all")
    for entry in env:
        name, eq, value = entry.partition("=")
        if not eq or not _ENV_NAME.fullmatch(name) or "\0" in value:
            raise ImageError(f"{what}: Env entry {entry[:80]!r} is not NAME=value (a name of letters, digits and '_')")
    if not isinstance(workdir, str) or len(workdir) > MAX_FIELD or _control(workdir) \
            or (workdir and not workdir.startswith("/")):
        raise ImageError(f"{what}: WorkingDir {str(workdir)[:80]!r} must be an absolute path without control "
                         "characters")
    if not isinstance(user, str) or (user and not all(_USER_PART.fullmatch(p) for p in user.split(":", 1))):
        raise ImageError(f"{what}: User {str(user)[:80]!r} must be empty, a name or uid, or user:group")
    return ImageConfig(tuple(env), workdir, user, os_name, arch)


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def load_json(raw: bytes, what: str) -> Any:
    """JSON from an image, strictly: UTF-8, no repeated keys (two readers could take different ones), no
    nesting deep enough to exhaust the parser."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ImageError(f"{what}: the key {key[:80]!r} appears twice in one JSON object")
            out[key] = value
        return out

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ImageError(f"{what}: not valid JSON ({str(exc)[:200]})") from None
