"""The raw HTTP client the VM egress tests run in the guest, to send requests no library would.

Each case of the JSON file its one argument names is sent on one connection of its own: `pieces` one after
another, `pause` seconds apart, over TLS through the job's CA when `tls` (with the server name `sni` if
given, else the name dialled), and everything that came back before the end is printed as a JSON pair
`[name, answer]`, an error's type after a " | ". A case with `resolve` only looks a name up instead.
"""

from __future__ import annotations

import textwrap

CLIENT = textwrap.dedent(
    """
    import json, socket, ssl, sys, time
    def run(case):
        if case.get("resolve"):
            try:
                return "resolved " + socket.gethostbyname(case["resolve"])
            except OSError as exc:
                return "unresolved " + type(exc).__name__
        got = b""
        try:
            sock = socket.create_connection((case["dial"], case["port"]), timeout=30)
            if case["tls"]:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=case.get("sni") or case["dial"])
            for at, piece in enumerate(case["pieces"]):
                if at:
                    time.sleep(case["pause"])
                try:
                    sock.sendall(piece.encode())
                except OSError:
                    break  # answered and closed already: read what came back
            while chunk := sock.recv(65536):
                got += chunk
            return got.decode("latin-1")
        except (OSError, ssl.SSLError) as exc:
            return got.decode("latin-1") + " | " + type(exc).__name__
    for name, case in json.load(open(sys.argv[1])).items():
        print(json.dumps([name, run(case)]), flush=True)
    """
)
