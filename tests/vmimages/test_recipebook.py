"""Recipes from the operator's directory and from --image: read with every problem at file:line, an image
recipe given base's VM, and `config check` reading them as `template build` does (no VM needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vmimages.recipe import Recipe, RecipeError
from vmimages.recipebook import check_dir, find, for_image, names, read


def test_an_image_recipe_gets_bases_vm_and_keeps_only_its_own_warmup(tmp_path: Path):
    (tmp_path / "node20.yml").write_text("name: node20\nimage: docker://registry.test:5000/node:20\n"
                                         "memory_mib: 1024\nwarmup:\n  - node --version\n")
    recipe = find("node20", tmp_path)
    base = Recipe.load("base")
    assert recipe.image == "docker://registry.test:5000/node:20"
    assert (recipe.packages, recipe.suite, recipe.kernel) == (base.packages, base.suite, base.kernel)
    assert recipe.memory_mib == 1024 and recipe.vcpus == base.vcpus
    assert recipe.warmup == ("node --version",)  # base's python3 warm-up would fail in an image without Python


def test_a_recipe_made_on_the_command_line_is_bases_vm_with_no_warmup():
    recipe = for_image("busy", "oci:/srv/images/busybox:1")
    assert (recipe.name, recipe.image, recipe.warmup) == ("busy", "oci:/srv/images/busybox:1", ())
    assert recipe.packages == Recipe.load("base").packages


def test_every_problem_of_a_recipe_is_reported_at_its_line(tmp_path: Path):
    path = tmp_path / "bad.yml"
    path.write_text("name: bad\nimage: docker-daemon:node:20\nvcpus: many\npackages: git\nwarmup: [1]\nfoo: 1\n")
    with pytest.raises(RecipeError) as caught:
        read(path)
    lines = str(caught.value).splitlines()
    assert [line.split(":")[1] for line in lines] == ["2", "3", "4", "5", "6"], lines
    assert "image:" in lines[0] and "vcpus: expected a whole number from 1 to 64" in lines[1]
    assert "unknown key 'foo'" in lines[4]


def test_a_recipe_name_must_match_its_file_and_may_not_take_a_builtin_name(tmp_path: Path):
    (tmp_path / "one.yml").write_text("name: two\nimage: oci:/srv/x:1\n")
    (tmp_path / "base.yml").write_text("name: base\nimage: oci:/srv/x:1\n")
    problems = check_dir(tmp_path)
    assert any("built-in name 'base'" in p for p in problems)
    assert any("one.yml:1:1: name: 'two' differs from the file's name 'one'" in p for p in problems), problems
    assert find("base", tmp_path) == Recipe.load("base")  # the built-in wins: `base` means one VM everywhere


def test_an_unknown_recipe_names_where_it_looked_and_how_to_make_one(tmp_path: Path):
    (tmp_path / "go.yml").write_text("image: oci:/srv/go:1\n")
    assert set(names(tmp_path)) >= {"base", "docker", "go"}
    with pytest.raises(RecipeError, match=r"no recipe named 'rust' in .* or .*known: base, docker, go.*--image REF"):
        find("rust", tmp_path)


def test_config_check_reads_the_operators_recipes(tmp_path: Path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "node20.yml").write_text("image: docker://registry.test:5000/node:20\n")
    config = tmp_path / "service.yml"
    config.write_text(f"recipes: {recipes}\ntemplates: [base, node20]\n")
    done = subprocess.run([sys.executable, "-m", "runner.cli", "config", "check", str(config)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "recipes: 1 in" in done.stdout and "(node20)" in done.stdout
    (recipes / "rust.yml").write_text("image: rust:slim\n")  # no transport: skopeo's syntax needs one
    done = subprocess.run([sys.executable, "-m", "runner.cli", "config", "check", str(config)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert f"{recipes / 'rust.yml'}:1:8: image:" in done.stderr, done.stderr


def test_the_documented_recipes_for_each_language_read_as_written():
    examples = Path(__file__).resolve().parents[2] / "examples" / "recipes"
    assert sorted(p.stem for p in examples.glob("*.yml")) == ["go123", "node20", "rust", "temurin21"]
    assert check_dir(examples) == []
    docs = (examples.parents[1] / "docs" / "images.md").read_text()
    for path in examples.glob("*.yml"):  # docs/images.md shows each file as it is
        assert f"# examples/recipes/{path.name} (copy it into your recipes: directory)\n{path.read_text()}" in docs
        assert find(path.stem, examples).image.startswith("docker://docker.io/library/")
