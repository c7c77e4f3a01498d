"""The service's signing key: Ed25519, made on the service's first start, the private half 0600.

The private key is written once, atomically (a temporary file opened 0600 and O_EXCL, then linked into
place), so two services starting at once agree on one key and no reader ever sees half a key. The
public key is derived from it, never stored apart: the API serves it and `attestation-key` prints it.
The keyid is the key's OpenSSH fingerprint (`SHA256:` and base64): a hint for finding the key, never a
reason to trust one, and the id other verifiers derive themselves (`keyid`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runner.errors import AttestationError

MAX_KEY_FILE_BYTES = 64 * 1024


def keyid(public: Ed25519PublicKey) -> str:
    """`SHA256:` and the unpadded base64 of the sha256 of the key in SSH's wire format: what `ssh-keygen -l`
    prints for it, and the id go-securesystemslib's DSSE verifier (cosign's, sigstore-go's) derives for a
    key given without one; a signature whose keyid differs from it is skipped there, never tried."""
    wire = base64.b64decode(public.public_bytes(serialization.Encoding.OpenSSH,
                                                serialization.PublicFormat.OpenSSH).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(wire).digest()).decode().rstrip("=")


def public_pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public(data: bytes, where: str) -> Ed25519PublicKey:
    """A PEM public key (as `attestation-key` prints it); AttestationError naming `where` otherwise."""
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise AttestationError(f"{where}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AttestationError(f"{where}: not an Ed25519 public key")
    return key


@dataclass(frozen=True)
class SigningKey:
    private: Ed25519PrivateKey
    path: Path

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @property
    def keyid(self) -> str:
        return keyid(self.public)

    @property
    def public_pem(self) -> str:
        return public_pem(self.public)

    @classmethod
    def load_or_create(cls, path: Path) -> SigningKey:
        """The key at `path`, made there first if there is none; its directory is made 0700."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            _create(path)
        return cls(_load(path), path)

    @classmethod
    def read(cls, path: Path) -> SigningKey:
        """The key at `path`, which must exist (reading a service's key without starting it)."""
        if not path.exists():
            raise AttestationError(f"{path}: no signing key yet (the service makes it on its first start)")
        return cls(_load(path), path)


def _create(path: Path) -> None:
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)  # fails if another start won the race: its key stands
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> Ed25519PrivateKey:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise AttestationError(f"{path}: cannot open the signing key: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_uid != os.geteuid():
            raise AttestationError(f"{path}: the signing key must be a regular file of this user's, mode 0600 "
                                   f"(it is {stat.filemode(info.st_mode)}, uid {info.st_uid}): fix it or remove it "
                                   "to make a new key (records signed with the old one then no longer verify)")
        data = handle.read(MAX_KEY_FILE_BYTES + 1)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as exc:
        raise AttestationError(f"{path}: not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AttestationError(f"{path}: not an Ed25519 private key")
    return key
