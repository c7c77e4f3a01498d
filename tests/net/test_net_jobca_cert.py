"""What a job's CA (runner/net/jobca.py) may vouch for, read from its certificates: it signs server
leaves only (path length 0: no intermediate it made is valid), lives a day, is valid for the job's
intercepted names only (name constraints, which a verifier enforces), has a key of its own per job,
its leaves are no CA and serve TLS servers only, and a job cannot make the host mint leaves without
bound (wildcard rules would otherwise let it name as many hosts as it likes)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from runner.net import jobca

HOSTS = ("pypi.test", "*.files.test")


def test_the_job_ca_signs_only_leaves_and_lives_a_day() -> None:
    ca = jobca.JobCA("job-1", HOSTS)
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and not usage.digital_signature and not usage.key_encipherment
    assert ca.cert.not_valid_after_utc - ca.cert.not_valid_before_utc <= datetime.timedelta(days=1, minutes=5)


def test_a_leaf_is_no_ca_and_serves_tls_servers_only() -> None:
    ca = jobca.JobCA("job-2", HOSTS)
    context = ca.server_context("pypi.test")
    assert isinstance(context, ssl.SSLContext)
    leaf = _leaf_of(context, ca)
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["pypi.test"]


def test_leaves_are_minted_for_at_most_max_leaves_names(monkeypatch) -> None:
    monkeypatch.setattr(jobca, "MAX_LEAVES", 2)
    ca = jobca.JobCA("job-3", ("*.test",))
    ca.server_context("a.test")
    ca.server_context("b.test")
    ca.server_context("a.test")  # already minted: no new one
    with pytest.raises(ValueError, match="minted 2 certificates already"):
        ca.server_context("c.test")


def _leaf_of(context: ssl.SSLContext, ca: jobca.JobCA, name: str = "pypi.test") -> x509.Certificate:
    """The leaf a server context presents for `name`, read back through a TLS handshake in memory
    by a client that trusts `ca` (raises when that client refuses it)."""
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_client = client.wrap_bio(c_in, c_out, server_hostname=name)
    tls_server = context.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (tls_client, tls_server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    der = tls_client.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_the_job_ca_is_valid_only_for_the_jobs_names_and_no_address() -> None:
    ca = jobca.JobCA("job-4", HOSTS)
    constraints = [found for found in ca.cert.extensions if isinstance(found.value, x509.NameConstraints)]
    assert len(constraints) == 1 and constraints[0].critical  # a verifier that cannot read it must refuse the CA
    extension = constraints[0]
    assert extension.value.permitted_subtrees == [x509.DNSName("files.test"), x509.DNSName("pypi.test")]
    assert extension.value.excluded_subtrees == [x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                                                 x509.IPAddress(ipaddress.ip_network("::/0"))]
    assert _leaf_of(ca.server_context("a.files.test"), ca, "a.files.test") is not None  # OpenSSL accepts its own leaves
    with pytest.raises(ssl.SSLCertVerificationError, match="permitted subtree violation"):
        _leaf_of(ca.server_context("evil.test"), ca, "evil.test")  # what a leaked key could mint


def test_each_job_ca_and_its_leaves_have_keys_of_their_own() -> None:
    first, second = jobca.JobCA("job-6", HOSTS), jobca.JobCA("job-7", HOSTS)
    keys = {_public(first.cert), _public(second.cert), _public(_leaf_of(first.server_context("pypi.test"), first)),
            _public(_leaf_of(second.server_context("pypi.test"), second))}
    assert len(keys) == 4


def _public(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
