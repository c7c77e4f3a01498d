"""The fake internet of the secret-binding tests (issue 35): a private package index behind basic auth
(idx.test, a real TLS server) that also echoes every request header back, another TLS host the host
reads (other.test) and a plain HTTP one (plain.test), each recording what reached it; and what those
tests run in the guest: the install from that index, and the search for a value in the guest."""

from __future__ import annotations

import base64
import gzip
import secrets
import textwrap
from contextlib import ExitStack
from pathlib import Path

from tests.net import net_fakes
from tests.vm.test_vm_network import IndexHandler

VALUE = "Tr0ub4dor-" + secrets.token_hex(12)  # what only the host and the upstream may see
INDEX_HOST, OTHER_HOST = "203.0.113.70", "203.0.113.71"
net_fakes.ZONE.update({"idx.test": INDEX_HOST, "other.test": OTHER_HOST})
REAL_AUTH = "Basic " + base64.b64encode(f"ci:{VALUE}".encode()).decode()
# A guest's pip install from the private index with only the placeholder of $INDEX_PASSWORD, and the
# installed module's greeting ("installed from the fake index") when it worked.
INSTALL = ('python3 -m pip install --disable-pip-version-check --no-cache-dir --retries 0 --timeout 20 '
           '--progress-bar off --break-system-packages --target /tmp/site '
           '--index-url "https://ci:$INDEX_PASSWORD@idx.test:8443/simple" demo-pkg && '
           "PYTHONPATH=/tmp/site python3 -c 'import demo_pkg; print(demo_pkg.GREETING)'")
# A guest script: prints every file under the guest's writable trees, and every process's environment and
# command line, that holds the value given as its two arguments (two halves, so that the value is put
# together in the finder's memory only, never in a file or a command line), then "searched".
FIND = textwrap.dedent(
    """
    import os, sys
    needle = (sys.argv[1] + sys.argv[2]).encode()
    for root in ("/etc", "/usr/local", "/tmp", "/root", "/workspace", "/var", "/home", "/run"):
        for top, _, names in os.walk(root):
            for name in names:
                path = os.path.join(top, name)
                try:
                    if os.path.isfile(path) and not os.path.islink(path) and needle in open(path, "rb").read():
                        print("file", path)
                except OSError:
                    pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("environ", "cmdline"):
            try:
                if needle in open(f"/proc/{pid}/{part}", "rb").read():
                    print("proc", pid, part)
            except OSError:
                pass
    print("searched")
    """
)


def halves(value: str) -> tuple[str, str]:
    """`value` cut in two, as FIND takes it."""
    return value[:len(value) // 2], value[len(value) // 2:]


class PrivateIndex(IndexHandler):
    """The fake index behind basic auth; /echo/ answers with every request header it got."""

    received: list[str] = []  # every request's head as it arrived

    def do_GET(self) -> None:
        self.received.append(f"{self.command} {self.path}\n{self.headers}")
        if self.headers.get("Authorization") != REAL_AUTH:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="private"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/echo/"):
            self.echo(gzipped=self.path.startswith("/echo/gzip"))
            return
        super().do_GET()

    def echo(self, *, gzipped: bool) -> None:
        text = str(self.headers).encode()
        self.send_response(200)
        self.send_header("X-Echo", self.headers.get("Authorization", ""))
        if gzipped:
            body = gzip.compress(text)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for at in range(0, len(text), 3):  # every value split across chunk boundaries
            piece = text[at:at + 3]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def do_POST(self) -> None:
        """Reads the whole body (chunked too) before answering, as a real server does."""
        if self.headers.get("Transfer-Encoding") == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                self.rfile.read(size + 2)
            self.rfile.readline()
        else:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received.append(f"{self.command} {self.path}\n{self.headers}")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Other(PrivateIndex):
    received: list[str] = []


class Plain(PrivateIndex):
    received: list[str] = []


def secret_internet(prefix: str, directory: Path, cleanup: ExitStack) -> tuple[str, Path]:
    """The fake internet with the three servers, removed through `cleanup`; (its namespace, the PEM
    file of the CA its TLS servers' certificates come from, which the host is told to trust)."""
    for handler in (PrivateIndex, Other, Plain):
        handler.received = []
    internet, servers, trusted, ca_file = net_fakes.trusted_internet(prefix, directory, cleanup)
    net_fakes.tls_server(internet, INDEX_HOST, 8443, "idx.test", trusted, directory, servers, handler=PrivateIndex)
    net_fakes.tls_server(internet, OTHER_HOST, 8443, "other.test", trusted, directory, servers, handler=Other)
    net_fakes.http_server_in(internet, net_fakes.RULES_HOST, 8080, Plain, cleanup)
    return internet, ca_file
