"""The guest agent's image mode (issue 34) on the host, no VM: a tiny image root made of Debian's static
busybox, and the agent's own code run on it in a child process in a private mount namespace
(`unshare --mount --propagation private`), so its mounts (proc, /dev, sysfs, tmpfs, resolv.conf)
never touch the host's and vanish with the process.

The pure parts (the spec, resolving paths inside the root, users from the image's files) are tested
in this process; what chroots and mounts needs root (a skip locally, a failure under CI=true).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from runner.vm import guestwire as P
from tests.conftest import require
from vmimages.rootfs import install_agent

BUSYBOX = "/bin/busybox"  # Debian's busybox-static


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("guest") / "opt" / "microvm-check"
    install_agent(path)
    return path


@pytest.fixture(scope="module")
def G(agent_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("installed_guest_agent_image", agent_dir / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the spec, paths and users: no root needed -------------------------------------------------------

def _spec(tmp_path: Path, value: object) -> str:
    path = tmp_path / "image.json"
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_the_spec_is_read_as_documented_and_no_file_is_the_base_template(G, tmp_path):
    assert G.IMAGE_SPEC == "/etc/microvm-check/image.json"
    for name in ('"root"', '"env"', '"workdir"', '"user"', "/etc/microvm-check/image.json"):
        assert name in G.__doc__  # the template build reads the docstring, not the code
    assert G.read_image_spec(str(tmp_path / "none.json")) is None
    (tmp_path / "img").mkdir()
    image = G.read_image_spec(_spec(tmp_path, {"root": str(tmp_path / "img"), "env": ["PATH=/x:/y", "A=b=c"],
                                               "workdir": "/app", "user": "node", "later": 1}))
    assert (image.root, image.env, image.workdir, image.user) == (str(tmp_path / "img"), {"PATH": "/x:/y", "A": "b=c"},
                                                                   "/app", "node")
    image = G.read_image_spec(_spec(tmp_path, {"root": str(tmp_path / "img")}))
    assert (image.env, image.workdir, image.user) == ({}, "", "")


@pytest.mark.parametrize("value, why", [
    ("{not json", "not UTF-8 JSON"),
    ([], "not an object"),
    ({}, '"root" must be an absolute path'),
    ({"root": "image"}, '"root" must be an absolute path'),
    ({"root": "/"}, "the guest's own root"),
    ({"root": "/no/such/image/root"}, "is not a directory"),
    ({"root": "ROOT", "env": "PATH=/bin"}, '"env" must be a list'),
    ({"root": "ROOT", "env": ["PATH"]}, '"env" holds'),
    ({"root": "ROOT", "env": [1]}, '"env" holds'),
    ({"root": "ROOT", "workdir": 5}, '"workdir" must be'),
    ({"root": "ROOT", "user": "a:b:c"}, '"user" must be'),
])
def test_a_malformed_spec_is_refused_with_why(G, tmp_path, value, why):
    if isinstance(value, dict) and value.get("root") == "ROOT":
        value = {**value, "root": str(tmp_path)}
    with pytest.raises(G.ImageSpecError) as got:
        G.read_image_spec(_spec(tmp_path, value))
    assert why in str(got.value)


def test_paths_resolve_inside_the_root_whatever_the_image_links_say(G, tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "app" / "sub").mkdir(parents=True)
    (root / "workspace").symlink_to("/app")
    (root / "app" / "abs").symlink_to("/etc/shadow")
    (root / "app" / "rel").symlink_to("../../../../etc")
    (root / "app" / "loop").symlink_to("loop")
    (root / "app" / "hop").symlink_to("/workspace/sub")
    r = str(root)
    assert G.resolve_in(r, "/workspace") == f"{r}/app"
    assert G.resolve_in(r, "/workspace/sub/x") == f"{r}/app/sub/x"
    assert G.resolve_in(r, "/workspace/abs") == f"{r}/etc/shadow"
    assert G.resolve_in(r, "/workspace/rel/passwd") == f"{r}/etc/passwd"
    assert G.resolve_in(r, "/../../etc/passwd") == f"{r}/etc/passwd"
    assert G.resolve_in(r, "/workspace/hop/../sub") == f"{r}/app/sub"  # ".." after a link: where the link led
    assert G.resolve_in(r, "/workspace/hop/..") == f"{r}/app"
    assert G.resolve_in(r, "/workspace/abs", follow_last=False) == f"{r}/app/abs"
    assert G.resolve_in(r, "/") == r and G.resolve_in(r, "") == r
    assert G.resolve_in(r, "/new/dir/file") == f"{r}/new/dir/file"
    with pytest.raises(OSError, match="too many levels"):
        G.resolve_in(r, "/app/loop/x")
    image = G.Image(r, {}, "/app", "")
    assert G.inside(image, f"{r}/app/sub") == "/app/sub" and G.inside(image, r) == "/"


def test_users_come_from_the_image_files_and_a_numeric_one_needs_none(G, tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n# a comment\nbroken line\n"
                                         "app:x:1234:1300:app:/home/app:/bin/sh\nnohome:x:77:77::::\n")
    (root / "etc" / "group").write_text("root:x:0:\napp:x:1300:\nextra:x:555:other,app\nother:x:556:other\n")
    image = G.Image(str(root), {}, "", "")
    assert G.image_user(image, "") == (0, 0, [], "/root")
    assert G.image_user(image, "app") == (1234, 1300, [555], "/home/app")
    assert G.image_user(image, "1234") == (1234, 1300, [555], "/home/app")
    assert G.image_user(image, "app:extra") == (1234, 555, [555], "/home/app")
    assert G.image_user(image, "app:42") == (1234, 42, [555], "/home/app")
    assert G.image_user(image, "1000:1000") == (1000, 1000, [], "/")
    assert G.image_user(image, "nohome") == (77, 77, [], "/")
    with pytest.raises(G.NotStartable, match="no user 'node' in its /etc/passwd"):
        G.image_user(image, "node")
    with pytest.raises(G.NotStartable, match="no group 'wheel' in its /etc/group"):
        G.image_user(image, "app:wheel")
    (root / "etc" / "passwd").unlink()
    assert G.image_user(G.Image(str(root), {}, "", ""), "") == (0, 0, [], "/")


# ---- the agent in image mode, in a private mount namespace: root needed ----------------------------

DRIVER = r'''
import base64, json, sys, threading
agent_dir, spec, cgroups = sys.argv[1:4]
sys.path.insert(0, agent_dir)
import agent as G
P = G.P
G.CGROUP_ROOT = cgroups
G.HOME_CGROUP.append(cgroups)


class Channel:
    def __init__(self):
        self.frames, self.lock = [], threading.Lock()

    def send(self, kind, rid, payload=b""):
        with self.lock:
            self.frames.append((kind, bytes(payload)))

    def reply(self, rid, message):
        with self.lock:
            self.frames.append((P.MSG, json.dumps(message).encode()))


G.enter_image_mode(spec)
results = []
for rid, message in enumerate(json.load(sys.stdin), 1):
    data = message.pop("_data", None)
    channel = Channel()
    req = G.Request(channel, rid, message)
    if data is not None:
        for chunk in data:
            req.inbox.put(P.Frame(P.DATA, rid, base64.b64decode(chunk)))
        req.inbox.put(P.Frame(P.END, rid, b""))
    G.handle(req)
    out = {P.STDOUT: b"", P.STDERR: b"", P.DATA: b""}
    messages = []
    for kind, payload in channel.frames:
        if kind == P.MSG:
            messages.append(json.loads(payload))
        elif kind in out:
            out[kind] += payload
    results.append({"reply": messages[-1], "stdout": out[P.STDOUT].decode(errors="replace"),
                    "stderr": out[P.STDERR].decode(errors="replace"), "data": base64.b64encode(out[P.DATA]).decode()})
print(json.dumps(results))
'''


def _need_namespaces() -> None:
    require(os.geteuid() == 0, "not running as root (chroot and mounts)")
    require(shutil.which("unshare") is not None, "unshare(1) (util-linux) is not installed")
    require(os.path.exists(BUSYBOX), f"{BUSYBOX} is missing (Debian's busybox-static)")


def make_image(root: Path, workdir_exists: bool = False) -> Path:
    """A busybox image: applets as links in /bin, a user app (1234), its own os-release, no python3."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1234:1234:app:/home/app:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\napp:x:1234:\nbuilders:x:555:app\n")
    (root / "etc" / "os-release").write_text('ID=tinybox\nPRETTY_NAME="the image"\n')
    (root / "etc" / "image-only").write_text("the image's secret\n")
    (root / "home" / "app").mkdir(parents=True)
    if workdir_exists:
        (root / "app").mkdir()
    return root


def run_agent(agent_dir: Path, tmp_path: Path, spec: str, requests: list[dict]) -> list[dict]:
    cgroups = tmp_path / "cgroups"
    cgroups.mkdir(exist_ok=True)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-S", "-B",
                           str(driver), str(agent_dir), spec, str(cgroups)],
                          input=json.dumps(requests), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])  # after what the agent logs
    assert len(results) == len(requests)
    return results


def sh(command: str, cwd: str = "/workspace", **extra) -> dict:
    return {"op": "exec", "shell": command, "cwd": cwd, "env": {}, "user": None, **extra}


@pytest.fixture
def image(tmp_path) -> Path:
    _need_namespaces()
    root = make_image(tmp_path / "image")
    spec = {"root": str(root), "env": ["PATH=/usr/local/bin:/bin", "IMAGE_VAR=from the image", "HOME=/home/app"],
            "workdir": "/app", "user": "app"}
    (tmp_path / "image.json").write_text(json.dumps(spec))
    return root


def _tar(members: dict[str, bytes], hardlinks: dict[str, str] | None = None) -> list[str]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (hardlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.LNKTYPE, target
            tar.addfile(info)
    return [base64.b64encode(buffer.getvalue()).decode()]


def test_commands_run_in_the_image_as_its_user_in_its_workdir_with_its_env(agent_dir, tmp_path, image):
    host_resolv = Path("/etc/resolv.conf").read_text() if Path("/etc/resolv.conf").is_file() else None
    results = run_agent(agent_dir, tmp_path, str(tmp_path / "image.json"), [
        {"op": "ping"},
        sh("cat /etc/os-release"),
        sh("id -u; id -g; id -G"),
        sh("pwd; echo $PWD; pwd -P", cwd="/workspace"),
        sh('echo "$PATH|$IMAGE_VAR|$HOME|$CI"', env={"CI": "true"}),
        sh("command -v python3 || echo no python3; which python3; echo $?"),
        {"op": "exec", "argv": ["python3", "-c", "1"], "cwd": "/workspace", "env": {}, "user": None},
        sh("id -u; echo $HOME", user="root"),
        sh("echo $PATH", env={"PATH": "/bin"}),
        sh("cat /etc/resolv.conf"),
        sh("test -c /dev/null && test -d /proc/self && test -d /sys/kernel && touch /tmp/x && echo mounts ok; "
           "touch /sys/x 2>/dev/null || echo sys read-only; stat -c %a /tmp"),
        sh("mkdir sub && cd sub && pwd", cwd="/workspace"),
        sh("pwd", cwd="/workspace/sub"),
        sh("true", cwd="/no/such/dir"),
        sh("true", user="nobody-here"),
        sh("echo built > built.txt"),
        {"op": "get_tar", "paths": ["built.txt"], "cwd": "/workspace", "max_bytes": 1 << 20},
    ])
    pong = results[0]["reply"]
    assert pong["ok"] and pong["image"] is True and "image_error" not in pong
    assert results[1]["stdout"] == 'ID=tinybox\nPRETTY_NAME="the image"\n'
    assert results[2]["stdout"].split("\n")[:3] == ["1234", "1234", "1234 555"]
    assert results[3]["stdout"] == "/app\n/app\n/app\n"
    assert results[4]["stdout"] == "/usr/local/bin:/bin|from the image|/home/app|true\n"
    assert results[5]["stdout"].startswith("no python3\n") and results[5]["stdout"].endswith("1\n")
    not_started = results[6]["reply"]
    assert not_started == {"ok": False, "error": "cannot start 'python3': No such file or directory"}
    assert results[7]["stdout"] == "0\n/home/app\n"  # the image's Env names HOME: it wins, as in Docker
    assert results[8]["stdout"] == "/bin\n"  # a PATH the host names for this command wins
    if host_resolv is not None:
        assert results[9]["stdout"] == host_resolv
    assert results[10]["stdout"] == "mounts ok\nsys read-only\n1777\n", results[10]
    assert results[11]["stdout"] == "/app/sub\n" and results[12]["stdout"] == "/app/sub\n"
    assert results[13]["reply"] == {"ok": False, "error": "cannot start '/bin/sh': the directory /no/such/dir does not "
                                                          "exist in the image"}
    assert results[14]["reply"] == {"ok": False, "error": "cannot start '/bin/sh': the image has no user "
                                                          "'nobody-here' in its /etc/passwd"}
    for result in results[1:6] + results[7:13] + results[15:16]:
        assert result["reply"]["ok"] is True, result
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(results[16]["data"]))) as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar] == [("built.txt", b"built\n")]
    # the WorkingDir was made (the image had none), for the image's user, and /workspace leads there
    assert os.readlink(image / "workspace") == "/app"
    assert (image / "app").stat().st_uid == 1234 and (image / "app" / "built.txt").read_text() == "built\n"
    assert not (tmp_path / "image" / "proc" / "self").exists()  # the mounts went with the namespace


def test_file_operations_mean_the_images_paths_and_never_leave_its_root(agent_dir, tmp_path, image):
    (image / "app").mkdir()
    (image / "app" / "secret").symlink_to("/etc/image-only")  # the guest has none: only the image's can be meant
    (image / "app" / "os").symlink_to("../../../../../../etc/os-release")
    (image / "app" / "etcdir").symlink_to("/etc")
    (image / "app" / "victim").symlink_to("/etc/image-only")
    marker = f"mvc-image-test-{os.getpid()}"
    assert not Path("/etc", marker).exists()
    data = [base64.b64encode(b"written\n").decode()]
    results = run_agent(agent_dir, tmp_path, str(tmp_path / "image.json"), [
        {"op": "read_file", "path": "/workspace/secret", "max_bytes": 4096},
        {"op": "read_file", "path": "/workspace/os", "max_bytes": 4096},
        {"op": "write_file", "path": f"/workspace/etcdir/{marker}", "_data": data},
        {"op": "write_file", "path": "/workspace/victim", "_data": data},
        {"op": "put_tar", "dest": "/workspace", "_data": _tar({f"etcdir/{marker}.tar": b"from tar\n",
                                                             "new/dir/file": b"deep\n"}, {"hard": "new/dir/file"})},
        {"op": "put_tar", "dest": "/workspace/etcdir", "_data": _tar({"tarred": b"x\n"})},
        sh(f"cat /etc/{marker} /etc/{marker}.tar /etc/tarred /workspace/new/dir/file; cat /workspace/victim"),
        {"op": "get_tar", "paths": ["image-only"], "cwd": "/workspace/etcdir", "max_bytes": 1 << 20},
    ])
    assert base64.b64decode(results[0]["data"]) == b"the image's secret\n"
    assert base64.b64decode(results[1]["data"]) == b'ID=tinybox\nPRETTY_NAME="the image"\n'
    for result in results[2:7]:
        assert result["reply"]["ok"] is True, result
    assert not Path("/etc", marker).exists() and not Path("/etc", f"{marker}.tar").exists()
    assert (image / "etc" / marker).read_text() == "written\n"
    assert not (image / "app" / "victim").is_symlink()  # the write replaced the link, never wrote through it
    assert (image / "etc" / "image-only").read_text() == "the image's secret\n"
    assert results[6]["stdout"] == "written\nfrom tar\nx\ndeep\nwritten\n"
    assert os.path.samefile(image / "app" / "hard", image / "app" / "new" / "dir" / "file")
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(results[7]["data"]))) as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar] == [("image-only", b"the image's secret\n")]


def test_a_terminal_runs_in_the_image_too(agent_dir, tmp_path, image):
    pty = {"op": "pty", "cwd": "/workspace", "env": {"TERM": "dumb"}, "rows": 24, "cols": 80, "timeout": 30,
           "user": None, "_data": []}
    results = run_agent(agent_dir, tmp_path, str(tmp_path / "image.json"), [
        {**pty, "argv": ["sh", "-c", "pwd; id -u; cat /etc/os-release; echo $IMAGE_VAR"]},
        {**pty, "argv": ["python3"]},
    ])
    assert results[0]["reply"]["ok"] is True and results[0]["reply"]["exit_code"] == 0, results[0]
    assert results[0]["stdout"].replace("\r\n", "\n") == ("/app\n1234\nID=tinybox\nPRETTY_NAME=\"the image\"\n"
                                                          "from the image\n")
    assert results[1]["reply"] == {"ok": False, "error": "cannot start 'python3': no such program in the image"}


def test_an_image_with_its_own_workspace_and_none_keep_the_checkout_at_workspace(agent_dir, tmp_path):
    _need_namespaces()
    root = make_image(tmp_path / "image")
    (root / "workspace").mkdir()
    (tmp_path / "a.json").write_text(json.dumps({"root": str(root), "workdir": "/app"}))
    bare = make_image(tmp_path / "bare")
    (tmp_path / "b.json").write_text(json.dumps({"root": str(bare)}))
    first = run_agent(agent_dir, tmp_path, str(tmp_path / "a.json"), [sh("pwd; id -u; echo $PATH")])
    second = run_agent(agent_dir, tmp_path, str(tmp_path / "b.json"), [sh("pwd; id -u; echo $HOME")])
    assert first[0]["stdout"] == f"/workspace\n0\n{P_DEFAULT}\n" and (root / "workspace").is_dir()
    assert second[0]["stdout"] == "/workspace\n0\n/root\n"
    assert (bare / "workspace").is_dir() and (bare / "workspace").stat().st_mode & 0o777 == 0o777


P_DEFAULT = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.mark.parametrize("spec", ['{"root": ', '{"root": "/no/such/root"}', '{"root": "ROOT", "env": "A=1"}'])
def test_a_malformed_spec_refuses_every_exec_and_file_operation(agent_dir, tmp_path, spec):
    _need_namespaces()
    root = make_image(tmp_path / "image")
    (tmp_path / "image.json").write_text(spec.replace("ROOT", str(root)))
    results = run_agent(agent_dir, tmp_path, str(tmp_path / "image.json"), [
        {"op": "ping"},
        sh("echo ran", cwd="/"),
        {"op": "pty", "argv": ["sh"], "cwd": "/", "env": {}, "rows": 24, "cols": 80, "timeout": 5, "_data": []},
        {"op": "read_file", "path": "/etc/os-release", "max_bytes": 4096},
        {"op": "write_file", "path": str(tmp_path / "written"), "_data": []},
    ])
    why = f"this is an image template, but its {tmp_path / 'image.json'} is unusable"
    assert results[0]["reply"]["image"] is False and results[0]["reply"]["image_error"].startswith(why)
    for result, program in zip(results[1:3], ("/bin/sh", "sh"), strict=True):
        assert result["reply"]["ok"] is False, result
        assert result["reply"]["error"].startswith(f"cannot start {program!r}: {why}") and result["stdout"] == ""
    for result in results[3:]:
        assert result["reply"]["ok"] is False and why in result["reply"]["error"], result
    assert not (tmp_path / "written").exists()


def test_without_a_spec_the_agent_is_the_base_agent(agent_dir, tmp_path):
    _need_namespaces()
    results = run_agent(agent_dir, tmp_path, str(tmp_path / "no-image.json"), [
        {"op": "ping"},
        sh("cat /etc/os-release; echo $PATH; echo $HOME; pwd", cwd=str(tmp_path)),
        {"op": "read_file", "path": "/etc/os-release", "max_bytes": 1 << 20},
    ])
    assert results[0]["reply"]["image"] is False and "image_error" not in results[0]["reply"]
    host = Path("/etc/os-release").read_text()
    assert results[1]["stdout"] == f"{host}{P_DEFAULT}\n/root\n{tmp_path}\n"
    assert base64.b64decode(results[2]["data"]) == host.encode()


def test_the_wire_protocol_is_unchanged_and_quiesce_finds_a_checkout_inside_the_image(G):
    assert set(G.OPS) == P.OPS
    root = G.CHECKOUT_ROOT  # the agent's own, outside the image: only the overlay's mount point is in it
    mounts = [f"/dev/sr0 {root}/medium ext4 ro,nosuid,nodev,relatime 0 0",
              f"overlay /image/app overlay rw,lowerdir={root}/medium/c:/image/app,upperdir={root}/upper,"
              f"workdir={root}/work,redirect_dir=on 0 0",
              "proc /image/proc proc rw,nosuid,nodev,noexec 0 0"]
    assert G.checkout_mounts(line + "\n" for line in mounts) == ["/image/app", f"{root}/medium"]
