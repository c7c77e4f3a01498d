"""The bounds on one OCI image: an image from a registry is a stranger's tarball, and every size, count and
wait it could blow up has a number here, checked before the work it bounds (a descriptor's size before its
blob is hashed, a member's size before its bytes are written)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class ImageLimits:
    """Defaults fit a language toolchain image (a Debian with Node.js or a JDK is 0.2-1 GiB compressed,
    under 100_000 files); lower them for tests or a small host, raise them for a bigger toolchain."""

    max_compressed_bytes: int = 4 * GiB  # all layer blobs together, as stored
    max_uncompressed_bytes: int = 8 * GiB  # the files' apparent sizes together (a sparse file counts whole)
    max_file_bytes: int = 4 * GiB  # one member
    max_files: int = 500_000  # members over all layers (each file, directory, link, whiteout)
    max_layers: int = 128
    max_json_bytes: int = 4 * MiB  # index, manifest, config
    max_path_bytes: int = 4096  # one member name or link target (Linux's PATH_MAX)
    max_path_depth: int = 128  # components of one member name
    fetch_timeout_seconds: float = 1800.0  # skopeo, whole: manifests and every blob

    @property
    def max_stream_bytes(self) -> int:
        """What the decompressors may hand out over all layers: the files' bytes plus up to 3 KiB of tar
        headers (a pax header, the header, padding) per allowed member."""
        return self.max_uncompressed_bytes + 3 * 1024 * self.max_files


DEFAULT_LIMITS = ImageLimits()
