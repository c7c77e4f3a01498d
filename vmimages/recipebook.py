"""Where recipes come from, and reading one file of them with every problem at its file:line.

Two places hold recipes: the built-in ones (vmimages/recipes/, part of the install) and the operator's
own directory (the service config's `recipes:`), which survives upgrades. An operator recipe may not
take a built-in's name: `base` means the same VM on every host.

A recipe with `image:` makes an image template. What it leaves out comes from `base` (the VM: suite,
packages, kernel, size), except `warmup`, which runs inside the image and so is the recipe's own.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from policy.yamldoc import (
    DocumentLimits,
    Problems,
    compose,
    decimal_int,
    kind,
    mapping,
    quote,
    read_text,
    sort_problems,
    string,
)
from vmimages.recipe import RECIPES_DIR, Recipe, RecipeError

LIMITS = DocumentLimits(noun="recipe", max_bytes=64 * 1024, max_depth=3,
                        shape="a recipe is a mapping of settings (name, packages, warmup, image, ...)")
FIELDS = tuple(Recipe.__dataclass_fields__)
LISTS = ("packages", "warmup", "kernel_modules")
INTS = {"memory_mib": (64, 262144), "vcpus": (1, 64), "disk_mib": (0, 1048576)}
IMAGE_BASE = "base"  # the built-in recipe whose VM an image template runs


def find(name: str, operator_dir: Path | None = None) -> Recipe:
    """The recipe called `name`; RecipeError naming where it looked when there is none."""
    builtin = RECIPES_DIR / f"{name}.yml"
    if builtin.exists():
        return read(builtin)
    if operator_dir is not None and (operator_dir / f"{name}.yml").exists():
        return read(operator_dir / f"{name}.yml")
    known = ", ".join(sorted(names(operator_dir)))
    where = f"{RECIPES_DIR}" + (f" or {operator_dir}" if operator_dir is not None else "")
    raise RecipeError(f"no recipe named {name!r} in {where} (known: {known}); write {name}.yml in the service "
                      "config's recipes: directory, or build it from an image: template build NAME --image REF")


def names(operator_dir: Path | None = None) -> list[str]:
    """Every recipe name offered: built in, then the operator's."""
    found = [p.stem for p in RECIPES_DIR.glob("*.yml")]
    if operator_dir is not None and operator_dir.is_dir():
        found += [p.stem for p in operator_dir.glob("*.yml") if p.stem not in found]
    return found


def check_dir(operator_dir: Path) -> list[str]:
    """Every problem of the operator's recipes, each at its file:line (config check)."""
    problems: list[str] = []
    for path in sorted(operator_dir.glob("*.yml")):
        if (RECIPES_DIR / path.name).exists():
            problems.append(f"{path}: a recipe may not take the built-in name {path.stem!r}: rename the file "
                            "(and its name:)")
            continue
        try:
            read(path)
        except RecipeError as exc:
            problems.append(str(exc))
    return problems


def for_image(name: str, image: str) -> Recipe:
    """An image template made on the command line (template build NAME --image REF): `base`'s VM."""
    _image_problem(image, None, Problems("--image"))
    return replace(read(RECIPES_DIR / f"{IMAGE_BASE}.yml"), name=name, image=image, warmup=())


def read(path: Path) -> Recipe:
    """The recipe in `path`, or RecipeError with all its problems."""
    problems = Problems(str(path), LIMITS.max_problems)
    text = read_text(path, LIMITS, problems)
    node = compose(text, LIMITS, problems) if text is not None else None
    values: dict[str, object] = {}
    if node is not None:
        if not isinstance(node, yaml.MappingNode):
            problems.at(node, f"a recipe is a mapping of settings, not {kind(node)}")
        else:
            values = _fields(node, problems)
            if values.get("name") not in (None, path.stem):
                problems.at(node, f"name: {quote(str(values['name']))} differs from the file's name "
                                  f"{path.stem!r}: they must agree")
    if problems.items:
        raise RecipeError("\n".join(str(p) for p in sort_problems(problems.final())))
    values["name"] = path.stem
    if values.get("image") and path.parent != RECIPES_DIR:
        base = read(RECIPES_DIR / f"{IMAGE_BASE}.yml")
        inherited = {k: getattr(base, k) for k in FIELDS if k not in values and k not in ("warmup", "name")}
        values = inherited | values
    return Recipe(**values)  # type: ignore[arg-type]


def _fields(node: yaml.MappingNode, problems: Problems) -> dict[str, object]:
    found, _ = mapping(node, FIELDS, "a recipe", problems)
    values: dict[str, object] = {}
    for key, value in found.items():
        if key in LISTS:
            values[key] = _strings(value, key, problems)
        elif key in INTS:
            number = decimal_int(value)
            low, high = INTS[key]
            if number is None or not low <= number <= high:
                problems.at(value, f"{key}: expected a whole number from {low} to {high}, not {kind(value)}")
            values[key] = number
        else:
            text = string(value)
            if text is None or not text.strip():
                problems.at(value, f"{key}: expected a text, not {kind(value)}")
            elif key == "image":
                _image_problem(text, value, problems)
            values[key] = text
    return values


def _strings(node: yaml.Node, key: str, problems: Problems) -> tuple[str, ...]:
    items = node.value if isinstance(node, yaml.SequenceNode) else None
    texts = [string(item) for item in items] if items is not None else [None]
    if any(text is None for text in texts):
        problems.at(node, f"{key}: expected a list of texts, not {kind(node)}")
        return ()
    return tuple(t for t in texts if t is not None)


def _image_problem(text: str, node: yaml.Node | None, problems: Problems) -> None:
    """A reference skopeo would not take, or one we refuse (vmimages.oci.reference), as a problem."""
    from runner.errors import TemplateError
    from vmimages.oci.reference import ImageRef

    try:
        ImageRef.parse(text)
    except TemplateError as exc:
        if node is None:
            raise RecipeError(f"--image {quote(text)}: {exc}") from None
        problems.at(node, f"image: {exc}")
