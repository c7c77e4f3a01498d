"""`microvm-check template build | list | rm`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import TemplateError, UserError
from runner.vm.statedir import StateDir
from runner.vm.templates import Template, TemplateNotFound, TemplateStore
from vmimages.recipe import Recipe, Size
from vmimages.run import BuildError

if TYPE_CHECKING:
    from runner.service.config.settings import ServiceConfig


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    template = subparsers.add_parser("template", help="build, list and remove VM templates")
    sub = template.add_subparsers(dest="template_command", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="build (or refresh) a template from its recipe: built in (vmimages/recipes/), "
                                         "the --config's recipes: directory, or --image")
    build.add_argument("name", nargs="?", default="base")
    build.add_argument("--image", metavar="REF", help="make NAME from an OCI image, in skopeo's syntax: "
                                                      "docker://HOST/NAME:TAG (or @sha256:...), oci:DIR:TAG, "
                                                      "oci-archive:FILE (docs/images.md)")
    build.add_argument("--refresh", action="store_true", help="an image template: fetch its reference again "
                                                              "(a tag may point elsewhere now) instead of the "
                                                              "digest its last build pinned")
    build.add_argument("--force", action="store_true", help="rebuild even if the recipe is unchanged")
    build.add_argument("--size", metavar="SIZE", help="bake it at a size class of the --config's sizes: "
                                                      "(the template NAME.SIZE that jobs with size: SIZE restore)")
    build.set_defaults(func=cmd_build)
    listing = sub.add_parser("list", help="list the baked templates")
    listing.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove a template")
    rm.add_argument("name")
    rm.add_argument("--yes", action="store_true", help="remove without asking")
    rm.set_defaults(func=cmd_rm)
    for cmd in (build, listing, rm):
        cmd.add_argument("--config", type=Path, help="the service config whose state_dir holds the templates "
                                                     "(default: $MICROVM_CHECK_STATE or /var/lib/microvm-check)")


def state_of(args: argparse.Namespace) -> StateDir:
    """The state directory a command works on: the service config's `state_dir` when --config names one,
    so `template build --config F` builds where `serve --config F` looks."""
    config = config_of(args)
    return StateDir.default() if config is None else StateDir(config.state_dir)


def config_of(args: argparse.Namespace) -> ServiceConfig | None:
    path = getattr(args, "config", None)
    if path is None:
        return None
    from runner.service.config.reading import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise UserError(f"{path} is not a valid service config:\n{exc}") from None


def size_of(args: argparse.Namespace) -> Size | None:
    """The size class --size names, from the --config's sizes: (where the service reads it too)."""
    if not getattr(args, "size", None):
        return None
    config = config_of(args)
    if config is None:
        raise UserError("template build --size needs --config: the size classes are the service config's sizes:")
    try:
        found = config.size(args.size)
    except KeyError:
        raise UserError(f"{args.config} has no size class {args.size!r} (its sizes: "
                        f"{', '.join(config.sizes or {}) or 'none'})") from None
    return Size(args.size, found.vcpus, found.memory_mib, found.disk_mib)


def cmd_build(args: argparse.Namespace) -> int:
    from runner.service.config.settings import Images
    from vmimages.build import build
    from vmimages.imageroot import ImageSource
    from vmimages.recipebook import for_image

    if os.geteuid() != 0:
        raise UserError("template build needs root (debootstrap, chroot): run it with sudo")
    config = config_of(args)
    try:
        recipe = for_image(args.name, args.image) if args.image else \
            Recipe.load(args.name, config.recipes if config else None)
        settings = config.images if config else Images()  # without --config: the settings' defaults
        images = ImageSource(settings.registries_conf, settings.authfile, disk_budget=settings.disk_budget)
        build(recipe, state_of(args), force=args.force, size=size_of(args), images=images, refresh=args.refresh)
    except (BuildError, TemplateError) as exc:
        raise UserError(f"template build failed: {exc}") from None
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Recipe templates and those made from VMs (warm bases, snapshots): size, age and last use, which
    are what the bases' disk budget evicts by."""
    store = TemplateStore(state_of(args).templates)
    templates = store.list()
    if not templates:
        print("no templates: build one with 'microvm-check template build'")
        return 0
    now = time.time()
    print(f"{'NAME':<32} {'DIGEST':<22} {'ACCEL':<5} {'MEMORY':>7} {'SIZE':>9} {'AGE':>6} {'LAST USE':>8}  FROM")
    for t in templates:
        size = f"{t.size_bytes() / 2**20:.0f} MiB"
        origin = _origin(t)
        print(f"{t.name:<32} {t.digest:<22} {t.manifest['accel']:<5} {t.manifest['memory_mib']:>5}Mi {size:>9} "
              f"{_ago(now - t.manifest['created']):>6} {_ago(now - store.last_used(t.name)):>8}  {origin}")
    return 0


def _origin(template: Template) -> str:
    """Where a template came from: its parent (made from a VM), its image (pinned digest), or its recipe."""
    if template.derived:
        return f"{template.manifest['parent']['name']} ({', '.join(template.variants)})"
    image = template.manifest.get("image")
    if isinstance(image, dict):
        return f"image {image.get('ref')} ({str(image.get('manifest_digest'))[:19]})"
    return "recipe"


def _confirm(question: str) -> bool:
    """Asked on the terminal; without one (a script, a pipe) nothing is removed unless --yes says so."""
    if not sys.stdin.isatty():
        raise UserError("template rm asks before removing: pass --yes when there is no terminal to answer")
    return input(question).strip().lower() in ("y", "yes")


def _ago(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds // length:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def cmd_rm(args: argparse.Namespace) -> int:
    store = TemplateStore(state_of(args).templates)
    if not (store.root / args.name).is_dir():
        raise UserError(f"no template named {args.name!r} in {store.root}")
    if not getattr(args, "yes", False) and not _confirm(f"remove template {args.name!r} from {store.root}? "
                                                         "jobs that name it fail until it is rebuilt [y/N] "):
        print("nothing removed", file=sys.stderr)
        return 1
    try:
        store.remove(args.name)
    except TemplateNotFound as exc:
        raise UserError(str(exc)) from None
    print(f"removed template {args.name}")
    return 0
