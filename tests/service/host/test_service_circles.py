"""No import circle in runner/service: each module can be read, tested and replaced from the modules it
imports, and none learns of its importers through a detour (issue 33).

A circle is a strongly connected component of the import graph (grimp's, as import-linter builds it;
imports under TYPE_CHECKING included: a type a module names is a dependency too). The graph is the whole
runner package, so a detour through a module outside the service is seen as well; a circle is named when
one of its modules is the service's.
"""

from __future__ import annotations

import grimp

SERVICE = "runner.service"


def circles(graph: grimp.ImportGraph, inside: str) -> list[list[str]]:
    """Each circle (strongly connected component of more than one module) with a module under `inside`,
    its modules sorted. A module's component is what it imports, even indirectly, that also imports it."""
    found: set[tuple[str, ...]] = set()
    for module in graph.modules:
        if not _under(module, inside):
            continue
        component = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if component:
            found.add(tuple(sorted(component | {module})))
    return sorted(list(component) for component in found)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_runner_service_has_no_import_circle() -> None:
    graph = grimp.build_graph("runner", cache_dir=None)
    assert len([m for m in graph.modules if _under(m, SERVICE)]) > 20  # the service was read, not missed
    found = circles(graph, SERVICE)
    assert found == [], "import circles in runner/service (break each, e.g. with a Protocol the importer " \
                        "declares, or a table both sides read): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_detector_finds_a_planted_circle() -> None:
    """A circle of three in the service, one through a module outside it, and no false circle from a
    chain into a circle or from a circle wholly outside the service: the test above can fail."""
    graph = grimp.ImportGraph()
    for importer, imported in [
        ("runner.service.a", "runner.service.b"), ("runner.service.b", "runner.service.c"),
        ("runner.service.c", "runner.service.a"),  # a -> b -> c -> a
        ("runner.service.d", "runner.other"), ("runner.other", "runner.service.d"),  # through the outside
        ("runner.service.e", "runner.service.a"),  # a chain into the circle: not part of it
        ("runner.x", "runner.y"), ("runner.y", "runner.x"),  # not the service's
    ]:
        graph.add_import(importer=importer, imported=imported)
    assert circles(graph, SERVICE) == [
        ["runner.other", "runner.service.d"],
        ["runner.service.a", "runner.service.b", "runner.service.c"],
    ]
