"""An image reference in skopeo's transport syntax, checked before any tool sees it.

Only three transports are accepted: `docker://` (a registry), `oci:` (an OCI layout directory) and
`oci-archive:` (a tar of one). The others skopeo knows reach into the host's own state (the Docker
daemon, containers-storage, a plain `dir:` of blobs nobody checksummed) or are not images at all, so a
template is never built from them. A registry reference names its host explicitly (no Docker Hub
default, no short-name search: the template says where its root filesystem came from) and a tag or a
digest explicitly (no implicit `latest`). `str(ref)` gives back exactly the reference parsed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from runner.errors import ImageError

DOCKER, OCI, OCI_ARCHIVE = "docker", "oci", "oci-archive"
OTHER_TRANSPORTS = ("docker-daemon", "docker-archive", "containers-storage", "dir", "ostree", "sif", "tarball")

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# distribution's reference grammar (github.com/distribution/reference), lower-case path components
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?")
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
MAX_REFERENCE = 4096
EXAMPLES = ("docker://registry.example.org/team/image:1.2, docker://registry.example.org/team/image@sha256:<64 hex>, "
            "oci:/abs/layout[:tag] or oci-archive:/abs/image.tar[:tag]")


@dataclass(frozen=True)
class ImageRef:
    """One image: a registry's `host/repository` with a tag or a digest, or a local OCI layout or archive.

    `path` is set for oci:/oci-archive: (absolute), `host` and `repository` for docker://; `tag` and
    `digest` are "" when not given (a docker:// reference has exactly one of them).
    """

    transport: str
    host: str = ""
    repository: str = ""
    path: str = ""
    tag: str = ""
    digest: str = ""

    def __str__(self) -> str:
        if self.transport == DOCKER:
            at = f"@{self.digest}" if self.digest else f":{self.tag}"
            return f"docker://{self.host}/{self.repository}{at}"
        return f"{self.transport}:{self.path}" + (f":{self.tag}" if self.tag else "")

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        """`parse_ref(text)`."""
        return parse_ref(text)

    @property
    def is_pinned(self) -> bool:
        """A registry reference by digest: what it names cannot change."""
        return self.transport == DOCKER and bool(self.digest)

    def pinned(self, digest: str) -> ImageRef:
        """This registry reference by `digest` (the tag it had resolved to once), so a rebuild gets the same
        bytes whatever the tag points at later. Only docker:// references have digests to pin to."""
        if self.transport != DOCKER:
            raise ImageError(f"{self}: only docker:// references can be pinned to a digest (a local layout or "
                             "archive is pinned by its own bytes)")
        if not DIGEST.fullmatch(digest):
            raise ImageError(f"{self}: cannot pin to {digest[:80]!r}: a digest is sha256: and 64 lower-case hex digits")
        return replace(self, tag="", digest=digest)


def parse_ref(text: str) -> ImageRef:
    """`text` as an ImageRef, or ImageError saying what is wrong and what to write instead."""
    if len(text) > MAX_REFERENCE or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ImageError(f"image reference {text[:80]!r}: control characters or longer than {MAX_REFERENCE} "
                         f"characters; write one of {EXAMPLES}")
    transport, colon, rest = text.partition(":")
    if not colon:
        raise ImageError(f"image reference {text[:200]!r} names no transport: write one of {EXAMPLES}")
    if transport == DOCKER:
        return _docker(text, rest)
    if transport in (OCI, OCI_ARCHIVE):
        return _local(text, transport, rest)
    if transport in OTHER_TRANSPORTS:
        raise ImageError(f"image reference {text[:200]!r}: the {transport}: transport is not accepted (templates "
                         f"are built only from a registry or an OCI layout or archive, whose blobs are checked by "
                         f"digest): push or save the image and write one of {EXAMPLES}")
    raise ImageError(f"image reference {text[:200]!r}: unknown transport {transport[:40]!r}: write one of {EXAMPLES}")


def _docker(text: str, rest: str) -> ImageRef:
    if not rest.startswith("//"):
        raise ImageError(f"image reference {text[:200]!r}: a registry reference starts with docker:// ({EXAMPLES})")
    location = rest[2:]
    location, at, digest = location.partition("@")
    if at and not DIGEST.fullmatch(digest):
        raise ImageError(f"image reference {text[:200]!r}: the digest must be sha256: and 64 lower-case hex digits")
    host, slash, name = location.partition("/")
    if not slash or not _HOST.fullmatch(host) or not ("." in host or ":" in host or host == "localhost"):
        raise ImageError(f"image reference {text[:200]!r}: name the registry host first (no Docker Hub default), "
                         f"e.g. docker://docker.io/library/debian:bookworm")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise ImageError(f"image reference {text[:200]!r}: tag {tag[:130]!r} is not a valid tag "
                             "(letters, digits, '_', '.', '-'; at most 128)")
    if not all(_COMPONENT.fullmatch(part) for part in name.split("/")) or len(name) > 255:
        raise ImageError(f"image reference {text[:200]!r}: repository {name[:200]!r} is not a valid name "
                         "(lower-case letters and digits, separated by '/', '.', '_' or '-')")
    if tag and at:
        raise ImageError(f"image reference {text[:200]!r}: give a tag or a digest, not both "
                         f"(docker://{host}/{name}@{digest})")
    if not tag and not at:
        raise ImageError(f"image reference {text[:200]!r}: no tag or digest; write :latest if that is what you mean "
                         f"(docker://{host}/{name}:latest)")
    return ImageRef(DOCKER, host=host, repository=name, tag=tag, digest=digest)


def _local(text: str, transport: str, rest: str) -> ImageRef:
    # skopeo splits oci:PATH:TAG at the first ':' (a path cannot hold one)
    path, _, tag = rest.partition(":")
    if not path.startswith("/") or "//" in path.rstrip("/") or any(p == ".." for p in path.split("/")):
        raise ImageError(f"image reference {text[:200]!r}: write the {transport}: path absolute and without '..' "
                         f"({transport}:/abs/path[:tag])")
    if ":" in rest and not _TAG.fullmatch(tag):
        raise ImageError(f"image reference {text[:200]!r}: tag {tag[:130]!r} is not a valid tag "
                         "(letters, digits, '_', '.', '-'; at most 128)")
    return ImageRef(transport, path=path, tag=tag)
