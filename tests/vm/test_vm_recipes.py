"""Template recipes: the `docker` variant's additions leave every other recipe's digest as it was."""

from __future__ import annotations

from dataclasses import asdict, replace

from vmimages import recipe
from vmimages.recipe import Recipe

ARGS = ("linux-image-6.1.0-57-amd64", "tcg", "QEMU emulator version 7.2", ["-machine", "microvm"])


def test_a_recipe_without_kernel_modules_keeps_its_digest_and_one_with_them_gets_another(monkeypatch) -> None:
    base = Recipe.load("base")
    assert base.kernel_modules == ()
    today = base.digest(*ARGS)
    # What the digest was before the field existed: the recipe's fields without it (hosts keep their
    # baked `base` only while these agree).
    monkeypatch.setattr(recipe, "ADDED_LATER", ())
    added = ("kernel_modules", "disk_mib", "image")
    monkeypatch.setattr(recipe, "asdict", lambda r: {k: v for k, v in asdict(r).items() if k not in added})
    assert base.digest(*ARGS) == today
    monkeypatch.undo()
    assert replace(base, kernel_modules=("kernel/net/bridge",)).digest(*ARGS) != base.digest(*ARGS)


def test_an_image_recipe_is_keyed_by_its_image_and_by_the_manifest_it_fetched() -> None:
    node = replace(Recipe.load("base"), name="node", image="docker://registry.test/node:20", warmup=())
    one = node.digest(*ARGS, image_digest="sha256:" + "1" * 64)
    assert one != node.digest(*ARGS, image_digest="sha256:" + "2" * 64)  # the tag moved: a new template
    assert one != replace(node, image="docker://registry.test/node:22").digest(*ARGS, image_digest="sha256:" + "1" * 64)


def test_the_docker_recipe_adds_the_engine_and_its_modules() -> None:
    docker = Recipe.load("docker")
    assert "docker.io" in docker.packages and "kmod" in docker.packages
    assert {"kernel/fs/overlayfs", "kernel/net/bridge", "kernel/drivers/net/veth.ko"} <= set(docker.kernel_modules)
    assert any("dockerd" in command for command in docker.warmup)
