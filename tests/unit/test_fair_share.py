"""The feeder's selection rule (weighted fair share of the lines in flight) and the
priority band, without stores."""

from __future__ import annotations

import pytest

from app.errors import InvalidRequest
from app.services.fair_share import FairShare
from app.services.priority import PriorityBand


def test_a_small_batch_gets_a_line_in_the_first_round_beside_a_huge_one() -> None:
    picks = FairShare().pick({"a": 50_000, "b": 1}, room=32)
    assert len(picks) == 32
    assert picks[:2] in (["a", "b"], ["b", "a"])
    assert picks.count("b") == 1 and picks.count("a") == 31


def test_equal_weights_share_the_room_equally_and_interleave() -> None:
    picks = FairShare().pick({"a": 100, "b": 100, "c": 100}, room=30)
    assert {t: picks.count(t) for t in "abc"} == {"a": 10, "b": 10, "c": 10}
    assert picks[:3] == ["a", "b", "c"] and picks[3:6] == ["a", "b", "c"]


def test_never_more_than_waiting_or_room() -> None:
    share = FairShare()
    assert share.pick({"a": 2, "b": 0}, room=10) == ["a", "a"]
    assert share.pick({}, room=10) == []
    assert share.pick({"a": 5}, room=0) == []


def test_the_turn_carries_over_between_calls() -> None:
    share = FairShare()
    # Room for one line per call: tenants take turns instead of "a" winning every call.
    assert [share.pick({"a": 9, "b": 9, "c": 9}, room=1)[0] for _ in range(6)] == list("abcabc")


def test_weights_give_proportional_shares() -> None:
    picks = FairShare({"a": 3.0}).pick({"a": 100, "b": 100}, room=40)
    assert picks.count("a") == 30 and picks.count("b") == 10


@pytest.mark.parametrize("weights", [{"a": 0.0}, {"a": -1.0}])
def test_weights_must_be_positive(weights: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FairShare(weights)


def test_default_band_lets_a_client_only_lower_its_priority() -> None:
    band = PriorityBand()
    assert band.resolve(None) == 0 and band.resolve(100) == 100
    for bad in (-1, 101, -(2**31), 2**31 - 1):
        with pytest.raises(InvalidRequest) as err:
            band.resolve(bad)
        assert err.value.param == "priority" and "0..100" in err.value.message


def test_a_demoted_tenant_defaults_to_its_band() -> None:
    assert PriorityBand(50, 90).resolve(None) == 50
    assert PriorityBand(-20, -10).resolve(None) == -10
    assert PriorityBand(-20, 10).resolve(None) == 0


@pytest.mark.parametrize(("low", "high"), [(5, 4), (-1001, 0), (0, 1001)])
def test_bands_stay_inside_the_documented_range(low: int, high: int) -> None:
    with pytest.raises(ValueError):
        PriorityBand(low, high)


def test_weights_given_per_call_apply_at_once_and_override_the_defaults() -> None:
    share = FairShare()
    picks = share.pick({"a": 100, "b": 100}, room=30, weights={"b": 2.0})
    assert picks.count("b") == 20 and picks.count("a") == 10
    picks = share.pick({"a": 100, "b": 100}, room=30)  # back to equal
    assert picks.count("b") == 15 and picks.count("a") == 15


def test_a_newcomer_takes_each_freed_slot_until_it_holds_its_share() -> None:
    """Tenant a holds 100 slots; 10 free up: all go to b, which holds none. Once b holds as
    many as a, they alternate again."""
    share = FairShare()
    assert share.pick({"a": 1000, "b": 50}, room=10, out={"a": 90}) == ["b"] * 10
    picks = share.pick({"a": 1000, "b": 40}, room=20, out={"a": 90, "b": 80})
    assert picks[:10] == ["b"] * 10 and sorted(picks[10:]) == ["a"] * 5 + ["b"] * 5


def test_weights_apply_to_the_slots_held() -> None:
    picks = FairShare().pick({"a": 1000, "b": 1000}, room=40, weights={"a": 3.0}, out={"a": 30, "b": 10})
    assert picks.count("a") == 30 and picks.count("b") == 10  # 60:20 after, 3:1
