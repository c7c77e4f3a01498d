"""Secrets a job can use and never read (issue 35), from a real VM in a fake internet with real TLS servers.

A private package index (idx.test) demands HTTP basic auth with the real value; the guest has only its
placeholder. The host terminates TLS to the bound host with the job's CA, puts the real credentials into
the requests the binding admits and refuses the placeholder everywhere else: another method or path,
a query (as sent, upper-cased, %-encoded), a body (split across chunks), another header, another TLS
host that the host reads, plain HTTP, a TLS server name, a DNS name. The index also echoes every request
header back (in a response header and in a chunked body cut into 3-byte chunks) and, on one path,
gzip-compresses that echo whatever it is asked: the guest must see the placeholder there, never the value,
and the compressed echo is refused. The upstreams record what reached them: the value only in the
requests the binding admits, the placeholder never.
"""

from __future__ import annotations

import base64
import json
import secrets
from contextlib import ExitStack

import pytest

from policy import load_policy
from policy.suggest import SECRET_REFUSED
from runner.net.secretswap import BoundSecret, SecretBinding, SecretSwap
from runner.sandbox import Sandbox
from tests.net import net_fakes
from tests.net.secret_fakes import (
    FIND,
    INSTALL,
    REAL_AUTH,
    VALUE,
    Other,
    Plain,
    PrivateIndex,
    halves,
    secret_internet,
)
from tests.vm.guest_client import CLIENT

POLICY = """\
version: 1
allow:
  - host: idx.test
    ports: [8443]
    methods: [GET, POST]
  - host: other.test
    ports: [8443]
    methods: [GET]
  - host: plain.test
    ports: [8080]
"""
BINDING = SecretBinding("index", "INDEX_PASSWORD", "idx.test", scheme="basic", user="ci", ports=frozenset({8443}),
                        paths=("/simple/*", "/files/*", "/echo/*"))


@pytest.fixture
def secret_engine(need_netns, make_engine, tmp_path):
    prefix = "v" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        internet, ca_file = secret_internet(prefix, tmp_path, cleanup)
        engine = make_engine(net=net_fakes.started_pool(prefix, internet, cleanup, upstream_ca=ca_file))
        cleanup.callback(engine.close)
        yield engine
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def get(host: str, path: str, *headers: str, port: int = 8443, method: str = "GET", body: str = "") -> str:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", *headers, "Connection: close"]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines) + "\r\n\r\n" + body


def case(host: str, *pieces: str, port: int = 8443, tls: bool = True, sni: str | None = None) -> dict[str, object]:
    """A CLIENT case: its pieces 0.3 s apart."""
    return {"dial": host, "port": port, "tls": tls, "pieces": list(pieces), "pause": 0.3,
            **({"sni": sni} if sni else {})}


def cases(placeholder: str) -> dict[str, dict[str, object]]:
    auth = "Authorization: Basic " + base64.b64encode(f"ci:{placeholder}".encode()).decode()
    escaped = "".join(f"%{byte:02X}" for byte in placeholder.encode())
    # bodies carry a type no framework reads fields from: a form body (or an untyped one) is refused by the
    # policy's methods: [GET, POST] before the binding is asked (policy/README.md)
    chunked = ("POST /upload HTTP/1.1\r\nHost: idx.test:8443\r\nContent-Type: application/octet-stream\r\n"
               "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    half = len(placeholder) // 2
    return {
        "echo": case("idx.test", get("idx.test", "/echo/headers", auth)),
        "echo gzip": case("idx.test", get("idx.test", "/echo/gzip", auth)),
        "no auth": case("idx.test", get("idx.test", "/simple/demo-pkg/")),
        "another method": case("idx.test", get("idx.test", "/simple/x", auth, "Content-Type: text/plain",
                                               method="POST", body="x")),
        "another path": case("idx.test", get("idx.test", "/admin/", auth)),
        "in the query": case("idx.test", get("idx.test", f"/simple/demo-pkg/?t={placeholder}", auth)),
        "in the query, upper-cased": case("idx.test", get("idx.test", f"/simple/?t={placeholder.upper()}")),
        "in the query, %-encoded": case("idx.test", get("idx.test", f"/simple/?t={escaped}")),
        "in another header": case("idx.test", get("idx.test", "/simple/demo-pkg/", f"X-Token: {placeholder}")),
        "as a bearer": case("idx.test", get("idx.test", "/simple/demo-pkg/", f"Authorization: Bearer {placeholder}")),
        "in a body, split across chunks": case(
            "idx.test", chunked + f"{half:x}\r\n{placeholder[:half]}\r\n",
            f"{len(placeholder) - half:x}\r\n{placeholder[half:]}\r\n0\r\n\r\n"),
        "pipelined behind an allowed request": case(
            "idx.test", get("idx.test", "/simple/demo-pkg/", auth).replace("Connection: close\r\n", "")
            + get("idx.test", f"/simple/?t={placeholder}")),
        "to another host the host reads": case("other.test", get("other.test", "/simple/", auth)),
        "to plain HTTP": case("plain.test", get("plain.test", "/simple/", auth, port=8080), port=8080, tls=False),
        "as the TLS server name": case("idx.test", get("idx.test", "/simple/"), sni=f"{placeholder}.idx.test"),
        "as a DNS name": {"resolve": f"{placeholder}.idx.test"},
        "as DNS labels": {"resolve": f"{placeholder[:20]}.{placeholder[20:]}.idx.test"},
    }


def test_a_bound_secret_goes_only_where_its_binding_says_and_never_comes_back(secret_engine):
    policy = load_policy(POLICY, "test policy")
    bound = BoundSecret.make(BINDING, VALUE)
    with Sandbox.create(engine=secret_engine, policy=policy) as sbx:
        env = sbx.bind_secrets(SecretSwap((bound,)))
        env |= sbx.install_job_ca()
        placeholder = env["INDEX_PASSWORD"]
        sbx.files.write("/tmp/client.py", CLIENT.encode())
        sbx.files.write("/tmp/cases.json", json.dumps(cases(placeholder)).encode())
        r = sbx.exec(["python3", "/tmp/client.py", "/tmp/cases.json"], env=env, timeout_seconds=600)
        assert r.exit_code == 0, r.stderr
        got = dict(json.loads(line) for line in r.stdout.decode().splitlines())
        pip = sbx.exec(INSTALL, env=env, timeout_seconds=300)
        sbx.files.write("/tmp/find.py", FIND.encode())
        found = sbx.exec(["python3", "/tmp/find.py", *halves(VALUE)], env=env, timeout_seconds=300)
        records = [rec for rec in sbx.blocked_egress() if rec.reason == SECRET_REFUSED]
        uses = sbx.secret_uses()
    without = _pip_without_binding(secret_engine, policy)

    assert placeholder != VALUE and VALUE not in json.dumps(env)
    assert pip.exit_code == 0 and b"installed from the fake index" in pip.stdout, pip.stdout + pip.stderr
    assert without.exit_code != 0 and b"installed from the fake index" not in without.stdout
    everything = r.stdout.decode() + pip.stdout.decode("latin-1") + pip.stderr.decode("latin-1")
    assert VALUE not in everything and VALUE.upper() not in everything.upper()
    assert REAL_AUTH.split()[1] not in everything
    head, _, body = got["echo"].partition("\r\n\r\n")
    masked = bound.header_value(bound.mask)  # Basic base64("ci:" + the placeholder), where the value was
    assert head.startswith("HTTP/1.1 200") and f"X-Echo: {masked}" in head, head
    assert f"Authorization: {masked}" in dechunked(body) and "Accept-Encoding: identity" in dechunked(body), body
    assert got["echo gzip"].startswith("HTTP/1.1 502") and "compressed" in got["echo gzip"], got["echo gzip"]
    assert got["no auth"].startswith("HTTP/1.1 401"), got["no auth"]
    refused = ["another method", "another path", "in the query", "in the query, upper-cased", "in the query, %-encoded",
               "in another header", "as a bearer", "in a body, split across chunks", "to another host the host reads",
               "to plain HTTP"]
    for name in refused:
        assert got[name].startswith("HTTP/1.1 403") and "placeholder of secret index" in got[name], (name, got[name])
    pipelined = got["pipelined behind an allowed request"]
    assert pipelined.startswith("HTTP/1.1 200") and "placeholder of secret index" in pipelined, pipelined
    assert "HTTP/1.1" not in got["as the TLS server name"] and "|" in got["as the TLS server name"]
    assert got["as a DNS name"].startswith("unresolved") and got["as DNS labels"].startswith("unresolved"), got
    assert found.exit_code == 0 and found.stdout.decode().split() == ["searched"], found.stdout + found.stderr

    arrived = "\n".join(PrivateIndex.received + Other.received + Plain.received)
    assert placeholder not in arrived and placeholder.upper() not in arrived.upper()
    assert "/admin/" not in arrived and "/upload" not in arrived and "t=" not in arrived
    assert not Other.received and not Plain.received
    assert all(("Authorization: " + REAL_AUTH) in head for head in PrivateIndex.received if "/echo/" in head)
    assert {rec.binding for rec in records} == {"index"}
    assert {rec.proto for rec in records} == {"tcp", "dns"}, records
    assert {rec.name for rec in records if rec.proto == "tcp"} >= {"idx.test", "other.test", "plain.test"}
    assert uses["index"] >= 4  # echo, echo gzip, the pipelined request, pip's page and wheel


def dechunked(body: str) -> str:
    """A chunked body's data."""
    data, rest = "", body
    while rest:
        size_line, _, rest = rest.partition("\r\n")
        size = int(size_line.split(";")[0], 16)
        if size == 0:
            return data
        data, rest = data + rest[:size], rest[size + 2:]
    return data


def _pip_without_binding(engine, policy):  # type: ignore[no-untyped-def]
    """The same install in a job without the binding: the index refuses it (401), so pip fails."""
    with Sandbox.create(engine=engine, policy=policy) as sbx:
        env = sbx.install_job_ca()
        return sbx.exec("python3 -m pip install --disable-pip-version-check --no-cache-dir --retries 0 --timeout 20 "
                        "--progress-bar off --break-system-packages --target /tmp/site "
                        "--index-url https://ci:guess@idx.test:8443/simple demo-pkg", env=env, timeout_seconds=300)

