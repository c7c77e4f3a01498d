"""What a job's VM restored from (`contract.RestoredFrom`), read from manifests as the host writes them: an image
template's build (`vmimages.imageroot.record`), a warm base derived from it (`TemplateStore.write_derived`), a
recipe's template, and a build gone before it was read. The wire form round-trips; a wrong type is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.jobapi.contract import ImageUsed, JobRecord, JobState, RestoredFrom, TemplateRef, WireError
from runner.vm.templates import Template, TemplateStore
from vmimages import imageroot
from vmimages.oci.config import ImageConfig
from vmimages.oci.fetch import FetchedImage
from vmimages.oci.reference import parse_ref

SOURCE_DIGEST = "sha256:" + "a" * 64
MANIFEST_DIGEST = "sha256:" + "b" * 64


def image_manifest(name: str = "node20", digest: str = "f00d") -> dict[str, object]:
    """An image template's manifest as vmimages/build.py writes it (the members this reads)."""
    ref = parse_ref("docker://127.0.0.1:5000/node:20")
    fetched = FetchedImage(MANIFEST_DIGEST, ImageConfig(env=("PATH=/usr/local/bin",)), (), SOURCE_DIGEST)
    entry = imageroot.record("docker://127.0.0.1:5000/node:20", ref, fetched, imageroot.Unpacked(Path("/x"), 3, 4096))
    return {"name": name, "digest": digest, "source": "image", "image": entry}


def test_an_image_templates_build_names_its_pinned_reference_and_the_manifest_it_unpacked() -> None:
    restored = RestoredFrom.of_manifest(image_manifest(), "tcg")
    assert restored == RestoredFrom(TemplateRef("node20", "f00d"), None,
                                    ImageUsed(f"docker://127.0.0.1:5000/node@{SOURCE_DIGEST}", MANIFEST_DIGEST), "tcg")
    assert restored.describe() == (f"node20 (f00d), image docker://127.0.0.1:5000/node@{SOURCE_DIGEST} "
                                   f"({MANIFEST_DIGEST}), tcg")


def test_a_warm_base_of_an_image_template_names_the_base_its_parent_and_the_parents_image(tmp_path: Path) -> None:
    parent_dir = tmp_path / "node20" / "f00d"
    parent_dir.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img"):
        (parent_dir / name).write_bytes(b"k")
    parent = Template("node20", "f00d", parent_dir, image_manifest())
    base_dir = tmp_path / "node20--net--o--r" / "be5e"
    base_dir.mkdir(parents=True)
    TemplateStore(tmp_path).write_derived(base_dir, parent, "net", {"base": {"repository": "o/r"}})
    restored = RestoredFrom.of_manifest(json.loads((base_dir / "manifest.json").read_text()), "kvm")
    assert (restored.template, restored.base) == (TemplateRef("node20", "f00d"),
                                                       TemplateRef("node20--net--o--r", "be5e"))
    assert restored.image == ImageUsed(f"docker://127.0.0.1:5000/node@{SOURCE_DIGEST}", MANIFEST_DIGEST)
    assert restored.describe().startswith("the base node20--net--o--r (be5e) of node20 (f00d), image ")


def test_a_recipes_template_has_no_image_and_a_gone_build_is_unknown() -> None:
    assert RestoredFrom.of_manifest({"name": "base", "digest": "d1", "source": "recipe"}, "tcg") == \
        RestoredFrom(TemplateRef("base", "d1"), accelerator="tcg")
    gone = RestoredFrom.of_manifest(None, None)
    assert gone == RestoredFrom(None) and gone.describe() == "a template build that was gone before it could be read"


def test_the_record_carries_it_over_the_wire_and_older_records_have_none() -> None:
    record = JobRecord(id="j1", state=JobState.RUNNING, repository="o/r", sha="a" * 40, run_id=None,
                       run_attempt=None, job_name="t", restored_from=RestoredFrom.of_manifest(image_manifest(), "tcg"))
    wire = json.loads(json.dumps(record.to_wire()))
    assert wire["restored_from"]["image"] == {"ref": f"docker://127.0.0.1:5000/node@{SOURCE_DIGEST}",
                                              "digest": MANIFEST_DIGEST}
    assert JobRecord.from_wire(wire) == record
    del wire["restored_from"]
    assert JobRecord.from_wire(wire).restored_from is None


@pytest.mark.parametrize("bad", [
    {"template": "base"}, {"template": {"name": "base"}}, {"template": None, "image": {"ref": 1, "digest": "d"}},
    {"template": None, "accelerator": 7}, [],
])
def test_a_malformed_restored_from_is_a_wire_error(bad: object) -> None:
    with pytest.raises(WireError):
        RestoredFrom.from_wire(bad)


def test_a_vm_resumed_from_a_second_hibernate_names_the_template_at_the_root_of_its_chain(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)

    def derived(name: str, digest: str, parent: Template, pooled: bool = False) -> Template:
        path = tmp_path / name / digest
        path.mkdir(parents=True)
        store.write_derived(path, parent, "nonet", {"sandbox": "j1"} if pooled else {"sandbox": "j1", "pooled": False})
        return Template(name, digest, path, json.loads((path / "manifest.json").read_text()))

    base_dir = tmp_path / "node20" / "f00d"
    base_dir.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img"):
        (base_dir / name).write_bytes(b"k")
    h1 = derived("sbx-j1-h1", "d1", Template("node20", "f00d", base_dir, image_manifest()))
    h2 = derived("sbx-j1-h2", "d2", h1)
    restored = RestoredFrom.of_manifest(h2.manifest, "tcg")
    assert (restored.template, restored.base) == (TemplateRef("node20", "f00d"), TemplateRef("sbx-j1-h2", "d2"))
    assert restored.image is not None and restored.image.digest == MANIFEST_DIGEST
    fork = derived("sbx-j1-1", "d3", h2, pooled=True)
    assert "pooled" not in fork.manifest  # a hibernate's "not pooled" is its own, not its forks'
