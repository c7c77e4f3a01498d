"""A certificate authority per job, for the HTTPS requests the host must read (`methods:`/`paths:`).

To check a request's method and path inside TLS the host terminates the guest's TLS itself: it
answers with a leaf certificate for the SNI, minted on first use by this job's CA, and opens its
own TLS connection upstream with full verification against the host's trust store
(`runner.net.nameproxy`). The guest trusts the CA because its certificate (never its key) is put
into the guest's trust store at job start (`runner.sandbox.Sandbox.install_job_ca`).

The CA's key lives only in this process's memory: it is made when a policy that needs it is
loaded into the slot and dropped when the slot is reset, so no two jobs share a CA and nothing a
job saw is valid for the next. The leaves' key is handed to OpenSSL through a memfd, never a file.
Validity is short (a day), the CA may sign nothing but server leaves (path length 0), and it is
valid only for the names of the job's `methods:`/`paths:` rules (critical name constraints:
permitted DNS subtrees of those names, every IP address excluded), so even a leaked key could
mint nothing a verifier would accept for another name.
"""

from __future__ import annotations

import datetime
import os
import secrets
import ssl
import threading
from dataclasses import dataclass, field
from ipaddress import ip_network

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = datetime.timedelta(days=1)
MAX_LEAVES = 256  # names one job may have certificates minted for; each is a policy host name


@dataclass(eq=False)
class JobCA:
    """One job's CA: `cert_pem` goes into the guest, the key never leaves this object."""

    label: str
    hosts: tuple[str, ...]  # the host patterns of the rules whose HTTPS the host reads (`Policy.intercepted_hosts`)
    _key: ec.EllipticCurvePrivateKey = field(repr=False, default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    _leaf_key: ec.EllipticCurvePrivateKey = field(repr=False, default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    cert: x509.Certificate = field(init=False)

    def __post_init__(self) -> None:
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"microvm-check job {self.label}"[:64]),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "microvm-check (per-job, host-held key)")])
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .add_extension(name_constraints(self.hosts), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for `name` (a policy-allowed, normalised name)."""
        with self._lock:
            context = self._contexts.get(name)
            if context is None:
                if len(self._contexts) >= MAX_LEAVES:
                    raise ValueError(f"job CA {self.label} has minted {MAX_LEAVES} certificates already")
                context = self._contexts[name] = self._context(name)
            return context

    def _context(self, name: str) -> ssl.SSLContext:
        now = datetime.datetime.now(datetime.UTC)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject).public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = leaf.public_bytes(serialization.Encoding.PEM) + self.cert_pem
        key = self._leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])  # the request framing the host reads is HTTP/1.x
        fd = os.memfd_create(f"mvc-leaf-{secrets.token_hex(4)}", os.MFD_CLOEXEC)
        try:
            os.write(fd, chain + key)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return context


def name_constraints(hosts: tuple[str, ...]) -> x509.NameConstraints:
    """The job CA's name constraints: a permitted DNS subtree per host pattern (`*.example.org`
    as `example.org`, the form every verifier reads; it also admits example.org itself, which no
    leaf is minted for), and no IP address at all (the leaves name hosts only)."""
    if not hosts:
        raise ValueError("a job CA needs the names it may vouch for; a policy without methods:/paths: needs no CA")
    subtrees = sorted({host.removeprefix("*.") for host in hosts})
    return x509.NameConstraints(
        permitted_subtrees=[x509.DNSName(subtree) for subtree in subtrees],
        excluded_subtrees=[x509.IPAddress(ip_network("0.0.0.0/0")), x509.IPAddress(ip_network("::/0"))])
