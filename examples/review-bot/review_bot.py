"""A pull-request review bot on the microvm-check SDK: it runs a PR's tests in a sandbox and writes the review.

    python3 review_bot.py --repository /srv/git/project.git --ref refs/pull/7/head [--socket S] [--base NAME]

The PR's tree comes out of the (bare) repository as a tar (`git archive`: no work tree, no hook, nothing
of the PR runs on this host), goes into a sandbox restored from a warm base (a snapshot of a sandbox
prepared once, with `--prepare` or by `prepare_base`), where `python3 -m unittest -v` runs with no network.
The review is Markdown on stdout, made from the results alone (no model call): the verdict, the failing
tests and the tail of their output. Run it as a user in the service's `sandboxes.group`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from microvm_check import ExecResult, Sandbox, Service

TEST_COMMAND = "python3 -m unittest -v 2>&1"
RESULT_LINE = re.compile(r"^(?P<name>\w+) \((?P<where>[\w.]+)\)(?: \.\.\.)? (?P<outcome>ok|FAIL|ERROR|skipped.*)$",
                         re.MULTILINE)
MAX_TAIL = 40


def prepare_base(service: Service) -> tuple[Sandbox, str]:
    """A sandbox set up once for every review (here: the workspace and the interpreter warmed), and a
    snapshot of it to restore each review's sandbox from. Keep the sandbox alive while the base is used."""
    prepared = Sandbox.create(ttl_seconds=1800, service=service)
    warmed = prepared.exec("mkdir -p /workspace && python3 -c 'import unittest, json'", timeout=120, cwd="/")
    if warmed.exit_code != 0:
        raise SystemExit(f"preparing the base failed: {warmed.stdout.decode(errors='replace')}")
    return prepared, prepared.snapshot()


def pr_tree(repository: str, ref: str) -> bytes:
    """The PR's files as a tar, read from the bare repository (git runs no code of the PR for this)."""
    # the tree, not the commit: git then writes no global pax header (the commit id), which the service's
    # safe tar reader refuses
    # and with no system or global git config, so no filter driver the PR's .gitattributes could name exists
    with tempfile.TemporaryDirectory(prefix="review-bot-home-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1"}
        done = subprocess.run(["git", "--git-dir", repository, "archive", "--format=tar", f"{ref}^{{tree}}"],
                              capture_output=True, timeout=120, env=env)
    if done.returncode != 0:
        raise SystemExit(f"git archive {ref} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout


def run_tests(service: Service, base: str, tree: bytes) -> ExecResult:
    with Sandbox.create(base=base, ttl_seconds=900, service=service) as sbx:
        sbx.upload(tree, dest="/workspace")
        return sbx.exec(TEST_COMMAND, timeout=600, cwd="/workspace")


def review(ref: str, result: ExecResult) -> str:
    """The review text, from the test run's output alone."""
    output = result.stdout.decode("utf-8", "replace")
    outcomes = [(m["name"], m["where"], m["outcome"]) for m in RESULT_LINE.finditer(output)]
    failed = [where if where.endswith(f".{name}") else f"{where}.{name}"  # 3.11 names the method in `where`
              for name, where, outcome in outcomes if outcome in ("FAIL", "ERROR")]
    passed = sum(1 for _, _, outcome in outcomes if outcome == "ok")
    if result.timed_out:
        verdict = "**Request changes**: the tests did not finish in time."
    elif result.exit_code == 0:
        verdict = f"**Approve**: all {passed} tests pass."
    else:
        verdict = f"**Request changes**: {len(failed)} failed, {passed} passed (exit {result.exit_code})."
    lines = [f"## Review of {ref}", "", verdict]
    if failed:
        lines += ["", "Failing tests:", *[f"- `{name}`" for name in failed]]
    if result.exit_code != 0:
        tail = output.strip().splitlines()[-MAX_TAIL:]
        lines += ["", "<details><summary>test output (tail)</summary>", "", "```", *tail, "```", "</details>"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", required=True, help="the bare repository standing in for GitHub")
    parser.add_argument("--ref", action="append", required=True, help="a PR ref to review (repeatable)")
    parser.add_argument("--socket", help="the service's socket (default: $MICROVM_CHECK_SOCKET or the default)")
    args = parser.parse_args()
    service = Service(socket=args.socket) if args.socket else Service.from_env()
    prepared, base = prepare_base(service)
    try:
        for ref in args.ref:
            sys.stdout.write(review(ref, run_tests(service, base, pr_tree(args.repository, ref))))
    finally:
        prepared.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
