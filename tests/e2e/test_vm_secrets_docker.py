"""A Docker Hub-like registry token flow through a secret binding (issue 35), on real VMs of the `docker`
template through a real service.

The test's fake internet has Debian's docker-registry at registry.test (TLS) with token auth: `GET /v2/`
answers 401 with `WWW-Authenticate: Bearer realm="https://auth.test/token",service="registry.test"`, and it
accepts only JWTs signed by the test's token key. The token server (auth.test, TLS) gives such a token only
to HTTP basic auth with the real password. The operator binds that password to auth.test's /token; the job
has only the placeholder, logs the guest's dockerd in with it (`docker login --password-stdin`, which
writes it to docker's config) and pulls and runs an image: dockerd asks the token server (the host swaps
the value in), then pulls with the bearer token. The same job's placeholder sent to the registry itself is
refused (403) and audited; a job of a repository without the binding cannot pull. The value is then looked
for in the guest (files, docker's config and log included, every process's environment and command line)
and everywhere the service keeps or shows something.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import logging
import secrets
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from policy.suggest import SECRET_REFUSED
from runner.jobapi.client import JobClient
from tests.conftest import require
from tests.e2e.vm_jobs import bound_service, output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.net import net_fakes
from tests.net.secret_fakes import FIND, halves

pytestmark = pytest.mark.vm

VALUE = "dckr_pat_" + secrets.token_hex(14)  # the robot account's password: only the host and auth.test see it
USER = "puller"
REGISTRY_HOST, AUTH_HOST = "203.0.113.50", "203.0.113.51"
net_fakes.ZONE.update({"registry.test": REGISTRY_HOST, "auth.test": AUTH_HOST})
REAL_AUTH = "Basic " + base64.b64encode(f"{USER}:{VALUE}".encode()).decode()

# Both hosts with methods, so the host reads their HTTPS in every job (the guest trusts no CA of the fake
# internet: both present the job's CA's certificates, with a binding or without).
STORE_POLICY = ("version: 1\nallow:\n  - host: auth.test\n    ports: [443]\n    methods: [GET]\n"
                "  - host: registry.test\n    ports: [443]\n    methods: [GET, HEAD]\n")
BINDINGS = f"""\
bindings:
  - name: registry
    repositories: [octo/hello]
    env: REGISTRY_PASSWORD
    host: auth.test
    paths: ["/token"]
    scheme: basic
    user: {USER}
    value_file: registry.secret
"""
PULL = ('printf %s "$REGISTRY_PASSWORD" | docker login -u puller --password-stdin registry.test && '
        "docker pull -q registry.test/db:1 && docker run --rm registry.test/db:1 echo pulled-and-$((40 + 2))")
# What docker's config holds for the registry: the placeholder (printed as a yes/no, never shown).
CONFIG = ("python3 -c \"import base64, json, os; a = json.load(open(os.path.expanduser('~/.docker/config.json')))"
          "['auths']['registry.test']['auth']; print('config holds the placeholder:', "
          "base64.b64decode(a).decode() == 'puller:' + os.environ['REGISTRY_PASSWORD'])\"")
# The registry without a token: 401 and its challenge. The placeholder sent to the registry, a host the
# binding does not name: refused before it leaves.
ELSEWHERE = ("python3 -c \"import base64, os, urllib.error, urllib.request as u\n"
             "try: u.urlopen('https://registry.test/v2/db/manifests/1', timeout=30)\n"
             "except urllib.error.HTTPError as e: print('no token:', e.code, e.headers['WWW-Authenticate'])\n"
             "r = u.Request('https://registry.test/v2/', headers={'Authorization': 'Basic ' + base64.b64encode(("
             "'puller:' + os.environ['REGISTRY_PASSWORD']).encode()).decode()})\n"
             "try: u.urlopen(r, timeout=30)\n"
             "except urllib.error.HTTPError as e: print('elsewhere:', e.code, e.read().decode())\"")
SIGNER = net_fakes.test_ca("token signer")  # the registry trusts tokens signed by this key (its rootcertbundle)


class TokenServer(http.server.BaseHTTPRequestHandler):
    """auth.test: Docker's token protocol (GET /token?service=...&scope=repository:<name>:pull, basic auth),
    answering a JWT the registry accepts only to the real credentials; records every request's head."""

    protocol_version = "HTTP/1.1"
    received: list[str] = []

    def do_GET(self) -> None:
        self.received.append(f"{self.command} {self.path}\n{self.headers}")
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/token" or self.headers.get("Authorization") != REAL_AUTH:
            self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]})
            return
        query = urllib.parse.parse_qs(url.query)
        access = []
        for scope in query.get("scope", []):
            kind, name, actions = scope.split(":", 2)
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a == "pull"]})
        now = int(time.time())
        claims = {"iss": "auth.test", "sub": USER, "aud": query.get("service", [""])[0], "iat": now,
                  "nbf": now - 60, "exp": now + 600, "jti": secrets.token_hex(8), "access": access}
        der = base64.b64encode(SIGNER[1].public_bytes(serialization.Encoding.DER)).decode()
        token = jwt.encode(claims, SIGNER[0], algorithm="ES256", headers={"x5c": [der]})
        self._answer(200, {"token": token, "access_token": token, "expires_in": 600,
                           "issued_at": datetime.datetime.now(datetime.UTC).isoformat()})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _registry(internet: str, directory: Path, trusted: tuple[Any, Any], stack: ExitStack) -> None:
    """Debian's docker-registry at registry.test:443 in the fake internet: TLS, token auth, one image."""
    binary = shutil.which("docker-registry")
    require(binary is not None, "docker-registry is not installed (scripts/setup --test installs it)")
    assert binary is not None
    net_fakes.seed_registry(directory / "registry", "db", "1")
    net_fakes.server_pem(trusted, "registry.test", directory / "registry.pem")
    (directory / "signer.pem").write_bytes(SIGNER[1].public_bytes(serialization.Encoding.PEM))
    (directory / "registry.yml").write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"},
        "http": {"addr": f"{REGISTRY_HOST}:443", "tls": {"certificate": str(directory / "registry.pem"),
                                                          "key": str(directory / "registry.pem")}},
        "storage": {"filesystem": {"rootdirectory": str(directory / "registry")}},
        "auth": {"token": {"realm": "https://auth.test/token", "service": "registry.test", "issuer": "auth.test",
                           "rootcertbundle": str(directory / "signer.pem")}}}))
    net_fakes.ip("-n", internet, "addr", "add", f"{REGISTRY_HOST}/32", "dev", "lo")
    log = (directory / "registry.log").open("wb")
    stack.callback(log.close)
    server = subprocess.Popen(["ip", "netns", "exec", internet, binary, "serve", str(directory / "registry.yml")],
                              stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        server.terminate()
        server.wait(timeout=30)

    stack.callback(stop)


@pytest.fixture
def docker_host(need_netns: None, vm_root: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(vm_root / "state" / "templates").get("docker")
    except TemplateNotFound as exc:
        require(False, str(exc))
    with ExitStack() as stack:
        prefix = "d" + secrets.token_hex(3)
        TokenServer.received = []
        internet, servers, trusted, ca_file = net_fakes.trusted_internet(prefix, tmp_path, stack)
        net_fakes.tls_server(internet, AUTH_HOST, 443, "auth.test", trusted, tmp_path, servers, handler=TokenServer)
        _registry(internet, tmp_path, trusted, stack)
        yield bound_service(stack, vm_root, tmp_path, internet, prefix, ca_file, policy=STORE_POLICY, bindings=BINDINGS,
                            value_file="registry.secret", value=VALUE, templates=["docker"])
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def test_docker_pulls_from_a_token_registry_through_a_basic_auth_binding_and_the_value_shows_nowhere(
        docker_host: Callable[..., Any], vm_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    host = docker_host()
    client = JobClient(socket=host.config.socket)
    find = "python3 /workspace/find.py {} {}".format(*halves(VALUE))  # docker's config, state and log too

    bound = submit(client, f"{PULL} && {CONFIG} && {ELSEWHERE}; {find}", files={"find.py": FIND.encode()},
                   repository="octo/hello", template="docker", timeout_seconds=900)
    bound_log = output(client, bound).decode("latin-1")
    record = client.get(bound)
    tokens_for_bound = list(TokenServer.received)
    guess = "REGISTRY_PASSWORD=dckr_pat_guess0123456789abcdef"  # no binding: a password of its own
    unbound = submit(client, f"{guess}; {PULL}; docker pull -q registry.test/db:1", repository="octo/other",
                     template="docker", timeout_seconds=900)
    unbound_log = output(client, unbound).decode("latin-1")
    unbound_record = client.get(unbound)
    system = b"".join(e.data for e in client.logs(bound) if e.stream == "system").decode()
    attestation = client.attestation(bound)
    host.service.drain()

    assert (record.state, record.exit_code) == ("finished", 0), (record, bound_log, system)
    assert "pulled-and-42" in bound_log.splitlines(), bound_log
    assert "config holds the placeholder: True" in bound_log, bound_log
    assert ('no token: 401 Bearer realm="https://auth.test/token",service="registry.test",'
            'scope="repository:db:pull"') in bound_log, bound_log
    assert "elsewhere: 403" in bound_log and "placeholder of secret registry" in bound_log, bound_log
    assert bound_log.rstrip().splitlines()[-1] == "searched", bound_log  # nothing of the value in the guest
    refused = [entry for entry in record.blocked_egress if entry.reason == SECRET_REFUSED]
    assert [entry.name for entry in refused] == ["registry.test"], record.blocked_egress
    assert "secret bindings: registry in $REGISTRY_PASSWORD" in system, system
    uses = [entry for entry in record.secrets_used if entry["name"] == "registry"]
    assert uses and uses[0]["requests"] >= 2, record.secrets_used  # docker login's token and the pull's
    # auth.test got the real credentials only, and a pull scope; the registry took its token (the image ran)
    assert tokens_for_bound and all(f"Authorization: {REAL_AUTH}" in head for head in tokens_for_bound), tokens_for_bound
    assert any("scope=repository%3Adb%3Apull" in head for head in tokens_for_bound), tokens_for_bound

    assert unbound_record.exit_code != 0 and "pulled-and-42" not in unbound_log.splitlines(), unbound_log
    # the token server refused the login and the anonymous pull, so the registry never gave the image
    assert unbound_log.count("unauthorized: bad credentials") == 2, unbound_log  # the login, the pull
    assert all(REAL_AUTH not in head for head in TokenServer.received[len(tokens_for_bound):])

    auth = REAL_AUTH.split()[1]
    for where, text in {"the job's log": bound_log + system, "its record": str(record.to_wire()),
                        "the other job's log": unbound_log, "the signed record": attestation.decode("latin-1"),
                        "the service log": caplog.text}.items():
        assert VALUE not in text and auth not in text, where
    for path in (vm_root / "state").rglob("*"):
        if path.is_file() and not path.is_symlink() and "templates" not in path.parts:
            data = path.read_bytes()
            assert VALUE.encode() not in data and auth.encode() not in data, path
