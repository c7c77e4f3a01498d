"""What a `methods:`/`paths:` rule lets through, from a real VM in a fake internet (issue 40).

Three upstreams record every request they serve. Two are lenient the way real servers are: a
Python `http.server` over HTTP and one over HTTPS (tls.test, read by the host through the job's CA)
that leave a GET's body unread on a kept-alive connection (so a body that is a second request is
served as one), honour `X-HTTP-Method-Override` and `X-Original-URL`, and read paths as Tomcat does
(`;` parameters dropped, then dot segments resolved: `/simple/..;/upload/x` is `/upload/x`). The
strict one reads every body it is announced, honours no override and serves paths as sent. Under
`paths: ["/simple/*"]` each attack must be refused with a 403 that says why and recorded with the
rule's name, must reach no upstream, and the allowed requests must still be served. A `raw: true`
name at the same address and port (raw.test and plain.test are one address, as on a CDN) must not
cancel the check there.
"""

from __future__ import annotations

import http.server
import json
import secrets
from contextlib import ExitStack

import pytest

from policy import load_policy
from policy.suggest import NAME_REFUSED, REQUEST_REFUSED
from runner.sandbox import Sandbox
from tests.net import net_fakes
from tests.vm.guest_client import CLIENT

POLICY = """\
version: 1
allow:
  - host: plain.test
    ports: [8080, 8081]
    methods: [GET, POST]
    paths: ["/simple/*"]
  - host: tls.test
    ports: [8443]
    methods: [GET, POST]
    paths: ["/simple/*"]
  - host: raw.test
    ports: [8080]
    raw: true
"""
LENIENT, STRICT, TLS = ("plain.test", 8080, False), ("plain.test", 8081, False), ("tls.test", 8443, True)

def tomcat_path(target: str) -> str:
    """The path a server that drops `;` parameters before resolving dot segments serves."""
    resolved: list[str] = []
    for segment in target.split("?", 1)[0].split("/")[1:]:
        segment = segment.split(";", 1)[0]
        if segment == "..":
            resolved = resolved[:-1]
        elif segment != ".":
            resolved.append(segment)
    return "/" + "/".join(resolved)


class Lenient(http.server.BaseHTTPRequestHandler):
    """Reads a body only on POST, PUT and PATCH, takes the method and URL from override headers,
    reads paths the Tomcat way; answers `<method> <path>`, keeping the connection alive."""

    protocol_version = "HTTP/1.1"
    served: list[str] = []

    def serve(self) -> None:
        if self.command in ("POST", "PUT", "PATCH"):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        method = self.headers.get("X-HTTP-Method-Override") or self.command
        path = tomcat_path(self.headers.get("X-Original-URL") or self.path)
        self.answer(f"{method} {path}")

    def answer(self, text: str) -> None:
        self.served.append(text)
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = serve

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass


class LenientTLS(Lenient):
    served: list[str] = []


class Strict(Lenient):
    """Reads every body it is announced, honours no override, serves the path as sent."""

    served: list[str] = []

    def serve(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer(f"{self.command} {self.path}")

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_TRACE = serve


def request(line: str, host: tuple[str, int, bool], *headers: str, close: bool = True) -> str:
    """One request head for `host` (name, port, tls), ending the connection after it unless `close` is False."""
    name, port, _ = host
    lines = [f"{line} HTTP/1.1", f"Host: {name}:{port}", *headers, *(["Connection: close"] if close else [])]
    return "\r\n".join(lines) + "\r\n\r\n"


def case(host: tuple[str, int, bool], *pieces: str, pause: float = 0.0, dial: str | None = None) -> dict[str, object]:
    name, port, tls = host
    return {"dial": dial or name, "port": port, "tls": tls, "pieces": list(pieces), "pause": pause}


def smuggling(host: tuple[str, int, bool], pause: float = 0.0) -> dict[str, object]:
    """A GET the rule allows whose body is a POST it refuses, then an allowed GET that ends the
    connection; the body comes `pause` seconds after the head."""
    hidden = request("POST /upload/x", host, "Content-Length: 0", close=False)
    head = request("GET /simple/ok/", host, f"Content-Length: {len(hidden)}", close=False)
    return case(host, head, hidden + request("GET /simple/end/", host), pause=pause)


def cases() -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for label, host in (("http", LENIENT), ("strict", STRICT), ("https", TLS)):
        found.update({
            f"{label} allowed GET": case(host, request("GET /simple/ok/", host)),
            f"{label} allowed POST": case(host, request("POST /simple/form", host, "Content-Type: text/plain",
                                                         "Content-Length: 5") + "hello"),
            f"{label} ;": case(host, request("GET /simple/..;/upload/x", host)),
            f"{label} ;jsessionid": case(host, request("GET /simple/x/..;jsessionid=1/..;/upload/x", host)),
            f"{label} GET body": smuggling(host),
            f"{label} GET body late": smuggling(host, pause=0.5),
            f"{label} method override": case(host, request("GET /simple/ok/", host, "X-HTTP-Method-Override: DELETE")),
            f"{label} URL override": case(host, request("GET /simple/ok/", host, "X-Original-URL: /upload/x")),
        })
    raw = ("raw.test", 8080, False)
    found["raw name at the checked port"] = case(raw, request("GET /upload/x", raw))
    found["checked name dialled by the raw name"] = case(LENIENT, request("GET /upload/x", LENIENT), dial="raw.test")
    return found


@pytest.fixture
def rules_engine(need_netns, make_engine, tmp_path):
    prefix = "v" + secrets.token_hex(3)
    for handler in (Lenient, LenientTLS, Strict):
        handler.served = []
    with ExitStack() as cleanup:
        internet, pool = net_fakes.tls_internet(prefix, tmp_path, cleanup, handler=LenientTLS)
        net_fakes.http_server_in(internet, net_fakes.RULES_HOST, 8080, Lenient, cleanup)
        net_fakes.http_server_in(internet, net_fakes.RULES_HOST, 8081, Strict, cleanup)
        engine = make_engine(net=pool)
        cleanup.callback(engine.close)
        yield engine
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def test_requests_a_server_could_read_another_way_are_refused_and_allowed_ones_pass(rules_engine):
    with Sandbox.create(engine=rules_engine, policy=load_policy(POLICY, "test policy")) as sbx:
        env = sbx.install_job_ca()
        sbx.files.write("/tmp/client.py", CLIENT.encode())
        sbx.files.write("/tmp/cases.json", json.dumps(cases()).encode())
        r = sbx.exec(["python3", "/tmp/client.py", "/tmp/cases.json"], env=env, timeout_seconds=600)
        assert r.exit_code == 0, r.stderr
        got = dict(json.loads(line) for line in r.stdout.decode().splitlines())
        records = {(rec.name, rec.reason, rec.method, rec.path) for rec in sbx.blocked_egress()}

    for label in ("http", "strict", "https"):
        assert got[f"{label} allowed GET"].startswith("HTTP/1.1 200") and got[f"{label} allowed GET"].endswith(
            "GET /simple/ok/"), got
        assert got[f"{label} allowed POST"].endswith("POST /simple/form"), got
        for attack, why in ((";", "no paths: glob admits this path: it has ';'"),
                            (";jsessionid", "no paths: glob admits this path: it has ';'"),
                            ("GET body", "no such rule admits a GET request with a body"),
                            ("GET body late", "no such rule admits a GET request with a body"),
                            ("method override", "no such rule admits the header x-http-method-override"),
                            ("URL override", "no such rule admits the header x-original-url")):
            answer = got[f"{label} {attack}"]
            assert answer.startswith("HTTP/1.1 403") and why in answer, (label, attack, answer)
    assert "HTTP/" not in got["raw name at the checked port"], got  # the raw name gives way to the check
    assert got["checked name dialled by the raw name"].startswith("HTTP/1.1 403"), got
    assert sorted(Lenient.served) == sorted(Strict.served) == sorted(LenientTLS.served) == [
        "GET /simple/ok/", "POST /simple/form"]
    assert {("plain.test", REQUEST_REFUSED, "GET", "/simple/*"), ("tls.test", REQUEST_REFUSED, "GET", "/simple/*"),
            ("plain.test", REQUEST_REFUSED, "GET", "/upload/*"), ("raw.test", NAME_REFUSED, "GET", "/upload/*")} \
        <= records, records
