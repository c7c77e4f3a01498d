"""The hashed locks (requirements/*.txt, made by scripts/lock) agree with pyproject.toml.

scripts/setup installs only from the locks, with `pip install --require-hashes`, and checks that
the venv then holds exactly the lock; so a dependency added to, removed from or narrowed in
pyproject.toml without running scripts/lock would silently not be what a host runs. These checks
need no network: each lock is read as the resolver wrote it, its `# via` lines included.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "requirements" / "runtime.txt"
TEST = ROOT / "requirements" / "test.txt"
PROJECT = "microvm-check (pyproject.toml)"
BUILD = "pyproject.toml [build-system]"


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: tuple[str, ...]
    via: frozenset[str]  # what required it: package names, PROJECT, BUILD or "-c <lock>"


def read_lock(path: Path) -> dict[str, Pin]:
    """The pins of a lock written by `uv pip compile --generate-hashes --annotation-style line`."""
    pins: dict[str, Pin] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        head = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", entry)
        if not head:
            assert entry.startswith("#"), f"{path.name}: not a pin: {entry[:80]!r}"
            continue
        via = re.search(r"# via (.+)", entry)
        pins[canonicalize_name(head[1])] = Pin(
            version=head[2],
            hashes=tuple(re.findall(r"--hash=(sha256:[0-9a-f]{64})", entry)),
            via=frozenset(v.strip() for v in via[1].split(",")) if via else frozenset(),
        )
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def direct(kind: str) -> list[Requirement]:
    meta = pyproject()
    reqs = list(meta["project"]["dependencies"]) + list(meta["build-system"]["requires"])
    if kind == "test":
        reqs += meta["project"]["optional-dependencies"]["test"]
    return [Requirement(r) for r in reqs]


LOCKS = {"runtime": RUNTIME, "test": TEST}


@pytest.mark.parametrize("kind", LOCKS)
def test_every_direct_dependency_is_pinned_within_its_range(kind: str) -> None:
    pins = read_lock(LOCKS[kind])
    for req in direct(kind):
        pin = pins.get(canonicalize_name(req.name))
        assert pin, f"{LOCKS[kind].name} lacks {req} from pyproject.toml: run scripts/lock"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"{LOCKS[kind].name} pins {req.name}=={pin.version}, outside pyproject.toml's {req}: run scripts/lock")


@pytest.mark.parametrize("kind", LOCKS)
def test_the_lock_pins_nothing_pyproject_no_longer_asks_for(kind: str) -> None:
    pins = read_lock(LOCKS[kind])
    wanted = {canonicalize_name(r.name) for r in direct(kind)}
    said_direct = {name for name, pin in pins.items() if pin.via & {PROJECT, BUILD}}
    assert said_direct == wanted, f"{LOCKS[kind].name} is stale (run scripts/lock): " \
                                  f"pinned as direct {sorted(said_direct - wanted)}, missing {sorted(wanted - said_direct)}"
    # every other pin is there because a pinned package needs it: nothing orphaned
    for name, pin in pins.items():
        parents = {canonicalize_name(v) for v in pin.via if v not in (PROJECT, BUILD) and not v.startswith("-c ")}
        assert pin.via and parents <= set(pins), f"{LOCKS[kind].name}: {name} is required by {sorted(parents)}"
        assert pin.via - {f"-c {RUNTIME.relative_to(ROOT)}"}, f"{LOCKS[kind].name}: {name} is pinned only as a constraint"


@pytest.mark.parametrize("kind", LOCKS)
def test_every_pin_is_exact_and_hashed(kind: str) -> None:
    for name, pin in read_lock(LOCKS[kind]).items():
        assert pin.hashes, f"{LOCKS[kind].name}: {name} has no --hash (pip --require-hashes would refuse it)"


def test_the_test_lock_runs_the_runtime_set_unchanged() -> None:
    """The tests run the versions a runner host runs: the test set is the runtime set plus test tools."""
    runtime, test = read_lock(RUNTIME), read_lock(TEST)
    changed = {n: (p.version, test[n].version if n in test else None) for n, p in runtime.items()
               if n not in test or test[n].version != p.version or set(p.hashes) - set(test[n].hashes)}
    assert not changed, f"requirements/test.txt differs from runtime.txt on {changed}: run scripts/lock"


def test_the_runtime_lock_holds_no_test_tool() -> None:
    runtime = read_lock(RUNTIME)
    tools = {canonicalize_name(Requirement(r).name) for r in pyproject()["project"]["optional-dependencies"]["test"]}
    assert not tools & set(runtime)


def test_a_stale_lock_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: a dependency added to pyproject.toml without scripts/lock."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text().replace(
        'dependencies = [\n', 'dependencies = [\n    "sortedcontainers>=2",\n', 1))
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # pyproject() reads it; the locks stay the real ones
    with pytest.raises(AssertionError, match="lacks sortedcontainers"):
        test_every_direct_dependency_is_pinned_within_its_range("runtime")
    with pytest.raises(AssertionError, match="stale"):
        test_the_lock_pins_nothing_pyproject_no_longer_asks_for("runtime")


def _bash_array(script: str, name: str) -> list[str]:
    """The words of `NAME=(...)`, which may span lines with a comment on each."""
    code = "\n".join(line.split("#", 1)[0] for line in script.splitlines())
    body = re.search(rf"^{name}=\(([^)]*)\)", code, re.M)
    assert body, f"scripts/setup has no {name}"
    return body[1].split()


def test_a_runner_host_gets_no_browser_and_no_test_tools() -> None:
    """scripts/setup's roles: the runtime packages only by default, the test-only ones with --test (scripts/test)."""
    setup = (ROOT / "scripts" / "setup").read_text()
    runtime, test_only = _bash_array(setup, "RUNTIME_APT_PACKAGES"), _bash_array(setup, "TEST_APT_PACKAGES")
    assert "qemu-system-x86" in runtime and "chromium" in test_only and "prometheus" in test_only
    assert not set(runtime) & set(test_only)
    assert "./scripts/setup --test" in (ROOT / "scripts" / "test").read_text()
    assert re.search(r"^\./scripts/setup$", (ROOT / "scripts" / "demo").read_text(), re.M)  # the demo: runtime only
    assert "--require-hashes -r" in setup and "pip install -q -e" not in setup


def test_no_service_of_a_test_package_runs_or_starts_at_boot() -> None:
    """Debian starts a package's own service when it installs it (prometheus on :9090, docker-registry on :5000,
    every interface). Every test-only package that ships one (a systemd unit or an init script) has it named in
    scripts/setup's TEST_SERVICES, which setup keeps from starting at install (policy-rc.d) and stops and
    disables on every run; scripts/test runs setup first, so here none runs or is enabled."""
    setup = (ROOT / "scripts" / "setup").read_text()
    named = set(_bash_array(setup, "TEST_SERVICES"))
    shipped: dict[str, str] = {}
    for package in _bash_array(setup, "TEST_APT_PACKAGES"):
        listed = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True)
        require(listed.returncode == 0, f"{package} is not installed (scripts/setup --test installs it)")
        for path in map(Path, listed.stdout.split()):
            if path.parent in (Path("/lib/systemd/system"), Path("/usr/lib/systemd/system"), Path("/etc/init.d")):
                shipped[path.name.removesuffix(".service")] = package
    assert {"prometheus", "docker-registry"} <= set(shipped)  # what dpkg says, so the check above can find one
    assert set(shipped) <= named, f"add to TEST_SERVICES in scripts/setup: {sorted(set(shipped) - named)}"
    for service in named:
        if Path("/run/systemd/system").is_dir():
            for query in ("is-active", "is-enabled"):
                answer = subprocess.run(["systemctl", query, service], capture_output=True, text=True).stdout.strip()
                assert answer not in ("active", "enabled"), f"{service} is {answer}"
        elif Path(f"/etc/init.d/{service}").exists():
            status = subprocess.run([f"/etc/init.d/{service}", "status"], capture_output=True, text=True)
            assert status.returncode != 0, f"{service} runs: {status.stdout}"
            starts = sorted(str(p) for p in Path("/etc").glob(f"rc[2-5].d/S??{service}"))
            assert starts == [], f"{service} starts at boot: {starts}"
