"""Review: a job naming a template its repository is not offered is refused at admission, before anything is
reserved, whatever the spec says; the store file's `templates:` offers one to its own repository only.
Pins the admission's check_template call (the spec's own check is unit-tested in test_spec.py)."""

from __future__ import annotations

import pytest

from runner.service.api.refusals import status_of
from runner.service.jobs.admission import InvalidJob
from tests.service.service_fakes import spec


@pytest.fixture
def service(make_service, tmp_path):
    policies = tmp_path / "policies"
    (policies / "octo").mkdir(parents=True)
    (policies / "octo" / "webapp.yml").write_text("version: 1\nallow: []\ntemplates: [node20]\n")
    return make_service(templates=["base"], policy_dir=str(policies))


def test_a_template_offered_to_another_repository_is_refused_before_anything_is_reserved(service) -> None:
    with pytest.raises(InvalidJob, match=r"template: 'node20' is not offered here to octo/hello") as err:
        service.submit({**spec("true"), "template": "node20"})
    assert status_of(err.value) == 400
    assert service.runs.all() == [] and list(service.config.jobs_dir.iterdir()) == []


def test_the_store_file_offers_its_own_repository_the_template(service) -> None:
    record = service.submit({**spec("true"), "repository": "octo/webapp", "template": "node20"})
    assert record.state == "awaiting_checkout" and service.runs.get(record.id).spec.template == "node20"
