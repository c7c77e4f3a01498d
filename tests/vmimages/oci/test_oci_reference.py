"""vmimages.oci.reference: the three transports skopeo is run with, everything else refused with what to write."""

from __future__ import annotations

import pytest

from runner.errors import ImageError
from vmimages.oci import ImageRef, parse_ref

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text, fields", [
    ("docker://registry.example.org/team/node:22", dict(host="registry.example.org", repository="team/node", tag="22")),
    ("docker://127.0.0.1:5000/busybox:1", dict(host="127.0.0.1:5000", repository="busybox", tag="1")),
    ("docker://localhost/a/b/c:latest", dict(host="localhost", repository="a/b/c", tag="latest")),
    (f"docker://docker.io/library/debian@{DIGEST}", dict(host="docker.io", repository="library/debian", digest=DIGEST)),
    ("oci:/srv/images/node", dict(transport="oci", path="/srv/images/node")),
    ("oci:/srv/images/node:v1.2", dict(transport="oci", path="/srv/images/node", tag="v1.2")),
    ("oci-archive:/srv/node.tar:v1", dict(transport="oci-archive", path="/srv/node.tar", tag="v1")),
])
def test_accepted_references_round_trip(text, fields) -> None:
    ref = parse_ref(text)
    assert {k: getattr(ref, k) for k in fields} == fields
    assert str(ref) == text
    assert parse_ref(str(ref)) == ref


@pytest.mark.parametrize("text, says", [
    ("docker-daemon:busybox:latest", "docker-daemon: transport is not accepted"),
    ("containers-storage:busybox", "containers-storage: transport is not accepted"),
    ("dir:/tmp/x", "dir: transport is not accepted"),
    ("docker-archive:/tmp/x.tar", "docker-archive: transport is not accepted"),
    ("ftp://x/y:1", "unknown transport"),
    ("busybox:latest", "unknown transport 'busybox'"),
    ("/srv/image", "names no transport"),
    ("docker://busybox:latest", "name the registry host first"),
    ("docker://library/busybox:latest", "name the registry host first"),
    ("docker:registry.example.org/a:1", "starts with docker://"),
    ("docker://registry.example.org/a", "no tag or digest; write :latest"),
    (f"docker://registry.example.org/a:1@{DIGEST}", "a tag or a digest, not both"),
    ("docker://registry.example.org/a@sha256:abc", "64 lower-case hex"),
    ("docker://registry.example.org/a@sha512:" + "0" * 128, "64 lower-case hex"),
    ("docker://registry.example.org/UPPER:1", "not a valid name"),
    ("docker://registry.example.org/a:-bad", "not a valid tag"),
    ("docker://registry.example.org/a:1\n", "control characters"),
    ("oci:relative/dir", "absolute"),
    ("oci:/srv/../etc", "without '..'"),
    ("oci:/srv/x:", "not a valid tag"),
])
def test_refused_references_say_what_to_write(text, says) -> None:
    with pytest.raises(ImageError, match=says.replace(".", r"\.").replace("(", r"\(")) as caught:
        parse_ref(text)
    assert "docker://" in str(caught.value) or "oci" in str(caught.value)


def test_a_tag_is_pinned_to_a_digest() -> None:
    ref = parse_ref("docker://127.0.0.1:5000/team/node:22")
    pinned = ref.pinned(DIGEST)
    assert str(pinned) == f"docker://127.0.0.1:5000/team/node@{DIGEST}" and pinned.is_pinned and not ref.is_pinned
    assert parse_ref(str(pinned)) == pinned
    with pytest.raises(ImageError, match="64 lower-case hex"):
        ref.pinned("sha256:xyz")
    with pytest.raises(ImageError, match="only docker:// references can be pinned"):
        parse_ref("oci:/srv/x").pinned(DIGEST)
    assert isinstance(pinned, ImageRef)
