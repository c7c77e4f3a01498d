"""Delivery dedup bounds and the redelivery sweep.

`GET /app/hook/deliveries` and `POST /app/hook/deliveries/{id}/attempts` are not in the provided
OpenAPI fragments: the item fields below follow GitHub's `hook-delivery-item` schema (id, guid,
delivered_at, redelivery, duration, status, status_code, event, action, installation_id,
repository_id) as published in octokit's OpenAPI types, not a stored fragment.
"""

from __future__ import annotations

from datetime import UTC

import pytest
import responses
from responses import matchers

from runner.github.app import parse_timestamp
from runner.github.client import GitHubClient
from runner.github.deliveries import DeliveryLog, RedeliverySweep
from tests.github.github_fakes import API, FakeClock

DELIVERIES = f"{API}/app/hook/deliveries"
NOW = "2026-11-30T12:00:00Z"


def item(id_: int, guid: str, minutes_ago: int, status_code: int, redelivery: bool = False) -> dict:
    delivered = parse_timestamp(NOW) - minutes_ago * 60
    from datetime import datetime

    stamp = datetime.fromtimestamp(delivered, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "id": id_, "guid": guid, "delivered_at": stamp, "redelivery": redelivery, "duration": 0.27,
        "status": "OK" if status_code == 200 else "Invalid HTTP Response: 502", "status_code": status_code,
        "event": "workflow_job", "action": "queued", "installation_id": 123, "repository_id": 456,
    }


@pytest.fixture
def sweep() -> RedeliverySweep:
    clock = FakeClock(parse_timestamp(NOW))
    client = GitHubClient(lambda: "jwt", clock=clock, sleep=clock.sleep)
    return RedeliverySweep(client, window=3600, clock=clock)


@responses.activate
def test_failed_deliveries_are_redelivered_once(sweep) -> None:
    page1 = [
        item(10, "guid-ok", 1, 200),
        item(9, "guid-failed", 2, 502),
        item(8, "guid-retried", 3, 200, redelivery=True),
        item(7, "guid-retried", 4, 500),
    ]
    page2 = [item(6, "guid-timeout", 30, 0), item(5, "guid-old", 61, 502)]
    first_page = [matchers.query_param_matcher({"per_page": "100"})]
    responses.get(DELIVERIES, json=page1, headers={"Link": f'<{DELIVERIES}?cursor=v1_6>; rel="next"'}, match=first_page)
    responses.get(f"{DELIVERIES}?cursor=v1_6", json=page2)
    attempts = [responses.post(f"{DELIVERIES}/{id_}/attempts", status=202, json={}) for id_ in (9, 6)]
    assert sweep.sweep() == [9, 6]
    assert [a.call_count for a in attempts] == [1, 1]
    # The next sweep sees the same failures but has already asked for them.
    assert sweep.sweep() == []
    assert [a.call_count for a in attempts] == [1, 1]


@responses.activate
def test_requested_guids_are_forgotten_once_they_leave_the_window(sweep) -> None:
    responses.get(DELIVERIES, json=[item(9, "guid-new", 1, 502), item(8, "guid-old", 50, 502)])
    responses.post(f"{DELIVERIES}/9/attempts", status=202, json={})
    responses.post(f"{DELIVERIES}/8/attempts", status=202, json={})
    assert sweep.sweep() == [9, 8]
    assert sweep._requested == {"guid-new", "guid-old"}
    sweep.clock.now += 20 * 60  # guid-old is now 70 minutes old, outside the one-hour window
    assert sweep.sweep() == []
    assert sweep._requested == {"guid-new"}


@responses.activate
def test_sweep_stops_at_the_window(sweep) -> None:
    responses.get(DELIVERIES, json=[item(5, "guid-old", 61, 502)],
                  headers={"Link": f'<{DELIVERIES}?cursor=never>; rel="next"'})
    assert sweep.sweep() == []
    assert len(responses.calls) == 1  # did not page further back than needed


@responses.activate
def test_unreadable_records_are_skipped(sweep) -> None:
    responses.get(DELIVERIES, json=[{"id": "x"}, "junk", item(4, "guid-bad", 1, 500)])
    responses.post(f"{DELIVERIES}/4/attempts", status=202, json={})
    assert sweep.sweep() == [4]


def test_delivery_log_is_bounded_and_forgets_after_ttl() -> None:
    clock = FakeClock(0.0)
    log = DeliveryLog(capacity=3, ttl=60, clock=clock)
    assert all(log.claim_all((guid,)) for guid in "abcd")
    assert len(log) == 3 and log.claim_all(("a",))  # the oldest was evicted
    assert not log.claim_all(("d",))
    clock.now += 61
    assert log.claim_all(("d",)) and len(log) == 1


def test_released_delivery_can_be_claimed_again() -> None:
    log = DeliveryLog()
    assert log.claim_all(("x",)) and not log.claim_all(("x",))
    log.release_all(("x",))
    assert log.claim_all(("x",))


def test_a_delivery_with_any_seen_key_claims_none() -> None:
    log = DeliveryLog()
    assert log.claim_all(("guid-1", "digest-1"))
    assert not log.claim_all(("guid-2", "digest-1"))  # same body under a new GUID
    assert log.claim_all(("guid-2", "digest-2"))  # guid-2 was not claimed by the refused call
    log.release_all(("guid-1", "digest-1"))
    assert log.claim_all(("guid-1", "digest-1"))


@responses.activate
def test_redeliver_command_sweeps_once(tmp_path, private_pem, capsys) -> None:
    from tests.github.github_fakes import run_cli

    key = tmp_path / "app.pem"
    key.write_text(private_pem)
    config = tmp_path / "github.yml"
    config.write_text(f"app_id: 1\nprivate_key_path: {key}\n")
    responses.get(DELIVERIES, json=[])
    assert run_cli(["redeliver", "--config", str(config)]) == 0
    assert "redeliver 0 failed deliveries" in capsys.readouterr().out
    assert responses.calls[0].request.headers["Authorization"].startswith("Bearer ey")  # the App JWT
