"""choose_template (runner/service/jobs/templatechoice.py): the one place that decides which template a VM
restores from, for jobs, pre-warmed VMs, kept VMs and sandboxes. No VMs: its warm bases are a stand-in."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy import load_policy
from runner.sandbox.port import TemplateChoice
from runner.service.jobs.bases import BaseSettings
from runner.service.jobs.templatechoice import choose_template

ALLOWS = load_policy("version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n", "test policy")


@dataclass
class Bases:
    """`RepositoryBases` as choose_template asks it: the base a repository has of a network variant."""

    ready: dict[tuple[str, bool], str] = field(default_factory=dict)
    asked: list[tuple[str, bool]] = field(default_factory=list)
    settings: BaseSettings = field(default_factory=lambda: BaseSettings(parent="base", budget_bytes=1,
                                                                         setup_timeout_s=1, max_checkout_bytes=1))

    def template_for(self, repository: str, network: bool) -> str:
        self.asked.append((repository, network))
        return self.ready.get((repository, network), self.settings.parent)


def test_the_named_template_without_bases_or_a_size() -> None:
    assert choose_template("base") == TemplateChoice("base", warm_base=False, size=None, why="the template base")


def test_a_size_class_selects_the_template_baked_at_it_and_no_warm_base() -> None:
    bases = Bases({("octo/hello", False): "base--nonet--octo--hello"})
    choice = choose_template("base", size="large", repository="octo/hello", bases=bases)  # type: ignore[arg-type]
    assert (choice.template, choice.warm_base, choice.size) == ("base.large", False, "large")
    assert bases.asked == []


def test_a_repositorys_warm_base_of_the_vms_network_variant() -> None:
    bases = Bases({("octo/hello", True): "base--net--octo--hello"})
    networked = choose_template("base", repository="Octo/Hello", policy=ALLOWS, bases=bases)  # type: ignore[arg-type]
    assert (networked.template, networked.warm_base) == ("base--net--octo--hello", True)
    assert "the repository's warm base base--net--octo--hello" in networked.why
    offline = choose_template("base", repository="octo/hello", bases=bases)  # type: ignore[arg-type]
    assert (offline.template, offline.warm_base) == ("base", False) and "no base" in offline.why
    assert bases.asked == [("octo/hello", True), ("octo/hello", False)]  # by its canonical name


def test_a_template_that_is_not_the_bases_parent_is_restored_as_named() -> None:
    bases = Bases()
    choice = choose_template("docker", repository="octo/hello", bases=bases)  # type: ignore[arg-type]
    assert (choice.template, choice.warm_base) == ("docker", False) and bases.asked == []
