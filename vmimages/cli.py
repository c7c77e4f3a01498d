"""`microvm-check template build | list | rm`."""

from __future__ import annotations

import argparse
import os
import time

from runner.errors import UserError
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateNotFound, TemplateStore
from vmimages.recipe import RecipeError
from vmimages.run import BuildError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    template = subparsers.add_parser("template", help="build, list and remove VM templates")
    sub = template.add_subparsers(dest="template_command", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build (or refresh) a template from its recipe in vmimages/recipes/")
    build.add_argument("name", nargs="?", default="base")
    build.add_argument("--force", action="store_true", help="rebuild even if the recipe is unchanged")
    build.set_defaults(func=cmd_build)
    listing = sub.add_parser("list", help="list the baked templates")
    listing.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove a template")
    rm.add_argument("name")
    rm.set_defaults(func=cmd_rm)


def cmd_build(args: argparse.Namespace) -> int:
    from vmimages.build import build

    if os.geteuid() != 0:
        raise UserError("template build needs root (debootstrap, chroot): run it with sudo")
    try:
        build(args.name, StateDir.default(), force=args.force)
    except (BuildError, RecipeError) as exc:
        raise UserError(f"template build failed: {exc}") from None
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Recipe templates and those made from VMs (warm bases, snapshots): size, age and last use, which
    are what the bases' disk budget evicts by."""
    store = TemplateStore(StateDir.default().templates)
    templates = store.list()
    if not templates:
        print("no templates: build one with 'microvm-check template build'")
        return 0
    now = time.time()
    print(f"{'NAME':<32} {'DIGEST':<22} {'ACCEL':<5} {'MEMORY':>7} {'SIZE':>9} {'AGE':>6} {'LAST USE':>8}  FROM")
    for t in templates:
        size = f"{t.size_bytes() / 2**20:.0f} MiB"
        origin = f"{t.manifest['parent']['name']} ({', '.join(t.variants)})" if t.derived else "recipe"
        print(f"{t.name:<32} {t.digest:<22} {t.manifest['accel']:<5} {t.manifest['memory_mib']:>5}Mi {size:>9} "
              f"{_ago(now - t.manifest['created']):>6} {_ago(now - store.last_used(t.name)):>8}  {origin}")
    return 0


def _ago(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds // length:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def cmd_rm(args: argparse.Namespace) -> int:
    try:
        TemplateStore(StateDir.default().templates).remove(args.name)
    except TemplateNotFound as exc:
        raise UserError(str(exc)) from None
    print(f"removed template {args.name}")
    return 0
