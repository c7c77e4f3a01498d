"""`methods:`/`paths:` over HTTPS from a real VM (issue 18): the host terminates TLS with the job's
own CA, whose certificate (never its key) the guest trusts from job start; the host verifies a real
TLS server of the fake internet against a test CA it was told to trust; pip installs through it."""

from __future__ import annotations

import base64
import json
import secrets
import textwrap
from contextlib import ExitStack

import pytest
from cryptography.hazmat.primitives import serialization

from policy import load_policy
from runner.sandbox import Sandbox
from tests.net import net_fakes
from tests.vm.test_vm_network import WHEEL, IndexHandler

POLICY = """\
version: 1
allow:
  - host: tls.test
    ports: [8443]
    methods: [GET]
    paths: ["/simple/*", "/files/*"]
  - host: untrusted.test
    ports: [8443]
    methods: [GET]
"""

REQUESTS = textwrap.dedent(
    """
    import json, sys, urllib.request, urllib.error
    def fetch(method, url):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"" if method == "POST" else None),
                                        timeout=20) as r:
                return "%d %s" % (r.status, r.read(200).decode("latin-1"))
        except urllib.error.HTTPError as e:
            return "%d %s" % (e.code, e.read(300).decode("latin-1"))
        except OSError as e:
            return "error " + str(e)
    for line in sys.argv[1:]:
        method, url = line.split(" ", 1)
        print(json.dumps([line, fetch(method, url)]))
    """
)


class Index(IndexHandler):
    """The fake package index, over TLS now."""


@pytest.fixture
def tls_engine(need_netns, make_engine, tmp_path):
    prefix = "v" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        _, pool = net_fakes.tls_internet(prefix, tmp_path, cleanup, handler=Index)
        engine = make_engine(net=pool)
        cleanup.callback(engine.close)
        yield engine
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def test_https_requests_are_checked_by_method_and_path_through_the_jobs_own_ca(tls_engine):
    policy = load_policy(POLICY, "test policy")
    checks = ["GET https://tls.test:8443/simple/demo-pkg/", "POST https://tls.test:8443/simple/x",
              "GET https://tls.test:8443/upload", "GET https://untrusted.test:8443/"]
    with Sandbox.create(engine=tls_engine, policy=policy) as sbx:
        env = sbx.install_job_ca()
        slot = sbx._vm.slot
        key = slot.proxy.ca._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption())
        needle = base64.b64encode(key).decode()[20:60]  # a stretch of the key's PEM body
        sbx.files.write("/tmp/requests.py", REQUESTS.encode())
        r = sbx.exec(["python3", "/tmp/requests.py", *checks], env=env, timeout_seconds=300)
        assert r.exit_code == 0, r.stderr
        result = dict(json.loads(line) for line in r.stdout.decode().splitlines())
        pip = sbx.exec("python3 -m pip install --disable-pip-version-check --no-cache-dir --retries 0 --timeout 20 "
                       "--progress-bar off --break-system-packages --target /tmp/site "
                       "--index-url https://tls.test:8443/simple demo-pkg && "
                       "PYTHONPATH=/tmp/site python3 -c 'import demo_pkg; print(demo_pkg.GREETING)'",
                       env=env, timeout_seconds=300)
        leak = sbx.exec(["sh", "-c", f"grep -rIl -e '{needle}' -e 'BEGIN PRIVATE KEY' /etc /usr/local /tmp /root "
                                     f"/workspace /proc/self/environ 2>/dev/null; env | grep -c -e '{needle}' || true"],
                        env=env, timeout_seconds=300)
        installed = sbx.files.read("/usr/local/share/ca-certificates/microvm-check-job.crt")
        records = {(rec.name, rec.reason, rec.method, rec.path) for rec in sbx.blocked_egress()}
    with Sandbox.create(engine=tls_engine, policy=policy) as second:
        second.install_job_ca()
        other = second.files.read("/usr/local/share/ca-certificates/microvm-check-job.crt")
    assert result[checks[0]].startswith("200 ") and WHEEL in result[checks[0]], result
    assert result[checks[1]].startswith("403 ") and "POST /simple/x on tls.test is not allowed" in result[checks[1]]
    assert result[checks[2]].startswith("403 ") and "GET /upload on tls.test is not allowed" in result[checks[2]]
    assert result[checks[3]].startswith("502 ") and "certificate of untrusted.test failed verification" in result[checks[3]]
    assert pip.exit_code == 0, pip.stdout + pip.stderr
    assert b"installed from the fake index" in pip.stdout
    assert leak.stdout.decode().split() == ["0"], leak.stdout  # no file has the key, no variable either
    assert {("tls.test", "request-refused", "POST", "/simple/*"), ("tls.test", "request-refused", "GET", "/upload"),
            ("untrusted.test", "upstream-untrusted", None, None)} <= records, records
    assert installed != other  # two jobs never share a CA
