"""The project's exception classes, found by importing every module (the guest's own files aside)."""

from __future__ import annotations

import importlib
import pkgutil

PACKAGES = ("runner", "policy", "action", "vmimages")
GUEST_SIDE = "vmimages.guest"  # runs inside the VM, imported there as top-level modules, never by the host


def project_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        names += [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")
                  if not info.name.startswith(GUEST_SIDE)]
    return names


def exception_classes() -> list[type[BaseException]]:
    """Every exception class a project module defines (not the ones it imports), in a stable order."""
    found: dict[str, type[BaseException]] = {}
    for name in project_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return [found[key] for key in sorted(found)]


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
