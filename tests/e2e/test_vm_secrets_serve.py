"""Secret bindings from the operator's config through a real service to real VMs (issue 35).

The service config names a bindings file; the binding's value sits in a root-only file. A job of the
bound repository installs from a private index that demands basic auth (a real TLS server in the
test's fake internet) using only the placeholder in its environment, and reads back an upstream that
echoes every request header; a job of another repository gets no binding and the install fails. The
value is then looked for everywhere the service keeps or shows something: the job's log, its record,
the records database, the job directory (log, artifacts, signed record), the service log and metrics
page. A job whose own policy tries to add a binding is told it cannot.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from runner.jobapi.client import JobAPIError, JobClient
from runner.service.api.page import COOKIE
from tests.e2e.vm_jobs import bound_service, output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.net import net_fakes
from tests.net.secret_fakes import INSTALL, VALUE, secret_internet

pytestmark = pytest.mark.vm

TOKEN = "a-test-token-of-32-characters-xx"  # the page's and /metrics' bearer (listen: on loopback)
STORE_POLICY = "version: 1\nallow:\n  - host: idx.test\n    ports: [8443]\n"
BINDINGS = """\
bindings:
  - name: index
    repositories: [octo/hello]
    env: INDEX_PASSWORD
    host: idx.test
    ports: [8443]
    paths: ["/simple/*", "/files/*", "/echo/*"]
    scheme: basic
    user: ci
    value_file: index.secret
"""
ECHO = ("python3 -c 'import os, urllib.request as u; r = u.Request(\"https://idx.test:8443/echo/h\"); "
        "r.add_header(\"Authorization\", \"Basic \" + __import__(\"base64\").b64encode(b\"ci:\" + "
        "os.environ[\"INDEX_PASSWORD\"].encode()).decode()); x = u.urlopen(r, timeout=20); "
        "print(x.headers[\"X-Echo\"]); print(x.read().decode())'")


@pytest.fixture
def secret_host(need_netns: None, vm_root: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    with ExitStack() as stack:
        prefix = "s" + __import__("secrets").token_hex(3)
        internet, ca_file = secret_internet(prefix, tmp_path, stack)
        yield bound_service(stack, vm_root, tmp_path, internet, prefix, ca_file, policy=STORE_POLICY, bindings=BINDINGS,
                            value_file="index.secret", value=VALUE, listen="127.0.0.1:0", token=TOKEN)
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def test_an_operator_binding_lets_a_job_install_from_a_private_index_and_the_value_shows_nowhere(
        secret_host, vm_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    host = secret_host()
    client = JobClient(socket=host.config.socket)
    address = host.api.tcp_address
    base = f"http://{address[0]}:{address[1]}"

    bound = submit(client, f"{INSTALL} && {ECHO}", repository="octo/hello", timeout_seconds=600)
    bound_log = output(client, bound).decode("latin-1")
    record = client.get(bound)
    unbound = submit(client, INSTALL, repository="octo/other", timeout_seconds=600)
    unbound_log = output(client, unbound).decode("latin-1")
    with pytest.raises(JobAPIError) as widened:
        client.submit({"repository": "octo/hello", "sha": "a" * 40, "command": "true",
                       "policy": STORE_POLICY + "secrets:\n  - name: index\n    host: evil.test\n"})
    system = b"".join(e.data for e in client.logs(bound) if e.stream == "system").decode()
    attestation = client.attestation(bound)
    metrics = host.service.health()
    pages = {where: httpx.get(base + path, cookies={COOKIE: TOKEN}, headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=30)
             for where, path in (("the jobs page", "/ui"), ("the job's page", f"/ui/jobs/{bound}"),
                                 ("the metrics", "/metrics"))}
    host.service.drain()

    assert (record.state, record.exit_code) == ("finished", 0), (record, bound_log)
    assert "installed from the fake index" in bound_log
    assert "installed from the fake index" not in unbound_log and client.get(unbound).exit_code != 0
    assert "secret bindings: index in $INDEX_PASSWORD" in system and "index 3 request(s) to idx.test" in system, system
    assert widened.value.status == 400 and "a policy cannot bind secrets" in str(widened.value), widened.value
    auth = base64.b64encode(f"ci:{VALUE}".encode()).decode()
    assert {where: page.status_code for where, page in pages.items()} == dict.fromkeys(pages, 200)
    assert "installed from the fake index" in pages["the job's page"].text  # the page shows the job's log
    for where, text in {"the job's log": bound_log + system, "its record": str(record.to_wire()),
                        "the signed record": attestation.decode("latin-1"), "the service log": caplog.text,
                        "the health answer": str(metrics),
                        **{where: page.text for where, page in pages.items()}}.items():
        assert VALUE not in text and auth not in text, where
    for path in (vm_root / "state").rglob("*"):
        if path.is_file() and not path.is_symlink() and "templates" not in path.parts:
            data = path.read_bytes()
            assert VALUE.encode() not in data and auth.encode() not in data, path
