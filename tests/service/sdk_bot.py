"""A bot on the host, run as an unprivileged user: it drives sandboxes of a running `serve` with the
client SDK (microvm_check) and prints one JSON line per fact the test checks.

argv: SOCKET MODE. Modes:
- tour: create, a streamed exec, files write/read/list, upload, download, a snapshot and a fork of it,
  one sandbox's token tried on the other, destroy;
- create: only try to create (a user outside the sandbox group is refused);
- hang: create with a short TTL, say so, then run a silent command until killed (kill -9 by the test).
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time

from microvm_check import Sandbox, SandboxError, Service


def say(**fact: object) -> None:
    print(json.dumps(fact), flush=True)


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tour(service: Service) -> None:
    with Sandbox.create(ttl_seconds=300, service=service) as sbx:
        say(created=sbx.id, accel=sbx.info.get("accel"))
        chunks: list[tuple[float, str, str]] = []
        result = sbx.exec("echo one; sleep 2; echo two >&2; exit 3", timeout=60, cwd="/",
                          on_output=lambda stream, data: chunks.append((time.monotonic(), stream, data.decode())))
        say(exit_code=result.exit_code, stdout=result.stdout.decode(), stderr=result.stderr.decode(),
            chunks=[[round(t - chunks[0][0], 2), s, d] for t, s, d in chunks])
        sbx.files.write("/workspace/notes.txt", b"written by the bot\n")
        say(read=sbx.files.read("/workspace/notes.txt").decode())
        sbx.upload(tar_of({"src/app.py": b"print('hi')\n", "README.txt": b"readme\n"}), dest="/workspace")
        say(listed=sorted(e.name for e in sbx.files.list("/workspace")))
        ran = sbx.exec("python3 src/app.py > out.txt; ls", timeout=60)
        say(ran=ran.exit_code, ls=ran.stdout.decode())
        tar = tarfile.open(fileobj=io.BytesIO(sbx.download("*.txt")))
        say(downloaded=sorted(tar.getnames()), out=tar.extractfile("out.txt").read().decode())
        with sbx.fork(ttl_seconds=300) as child:
            say(forked=child.id, fork_read=child.files.read("/workspace/notes.txt").decode())
            stranger = Sandbox(service, {"id": child.id}, sbx.token)  # the parent's token on the child
            try:
                stranger.files.read("/workspace/notes.txt")
                say(cross="reached")
            except SandboxError as exc:
                say(cross=exc.status, cross_message=str(exc))
            finally:
                stranger._sender.close()
            child.files.write("/workspace/notes.txt", b"changed in the fork\n")
        say(parent_read=sbx.files.read("/workspace/notes.txt").decode())
    say(destroyed=sbx.id)
    again = Sandbox(service, {"id": sbx.id}, sbx.token)  # its own token, once the sandbox is gone
    try:
        again.files.read("/workspace/notes.txt")
        say(after_destroy="reached")
    except SandboxError as exc:
        say(after_destroy=exc.status)
    finally:
        again._sender.close()


def main() -> None:
    socket, mode = sys.argv[1], sys.argv[2]
    service = Service(socket=socket)
    if mode == "tour":
        tour(service)
    elif mode == "create":
        try:
            Sandbox.create(ttl_seconds=60, service=service).destroy()
            say(create="allowed")
        except SandboxError as exc:
            say(create=exc.status, message=str(exc))
    elif mode == "hang":
        sbx = Sandbox.create(ttl_seconds=float(sys.argv[3]), service=service)
        say(created=sbx.id, vm_id=sbx.info["vm_id"])
        sbx.exec("echo started; sleep 600", timeout=600, on_output=lambda stream, data: say(output=data.decode()))


if __name__ == "__main__":
    main()
