"""The resend decisions of app/liveness.py, row by row of its table: pure functions of what
the sweeper observed, no Redis or Postgres. Rows 2, 3, 9 and 12 never reach the planner
(`stale_queued` keeps them out: tests/api/test_sweeper.py checks that query, and the lease
releases of rows 10-11 against Postgres); here they are checked where the planner sees them."""

from __future__ import annotations

from app.liveness import (
    Observed,
    Stale,
    plan_resends,
    plan_unclaimed,
    sent_before,
    vanish_candidates,
)


def single(job_id: str, *, never_sent: bool = False, model: str = "m") -> Stale:
    return Stale(job_id, model, 0, None, never_sent)


def line(job_id: str, *, model: str = "m") -> Stale:
    return Stale(job_id, model, 0, "batch_1", False)


def test_row_1_a_single_job_never_sent_is_sent_without_any_check() -> None:
    job = single("a", never_sent=True)
    assert sent_before([job]) == []  # its marker is not even looked at
    assert vanish_candidates([job], set()) == []

    plan = plan_resends([job], Observed(missing=set()))

    assert plan.send == [job] and plan.hand_back == [] and plan.forget == set()
    assert plan.confirm == ["a"] and plan.resent == 1


def test_row_4_a_single_job_whose_marker_is_gone_is_sent_again() -> None:
    job = single("a")
    assert sent_before([job]) == ["a"]

    plan = plan_resends([job], Observed(missing={"a"}))

    assert plan.send == [job] and plan.confirm == ["a"] and plan.forget == set()


def test_row_4_a_batch_line_whose_marker_is_gone_goes_back_to_the_feeder() -> None:
    plan = plan_resends([line("l")], Observed(missing={"l"}))

    assert plan.send == [] and plan.hand_back == ["l"]
    assert plan.confirm == []  # its `enqueued_at` becomes null instead (row 2)
    assert plan.resent == 1


def test_row_5_a_job_waiting_behind_a_backlog_is_only_confirmed() -> None:
    job = single("a")
    assert vanish_candidates([job], set()) == [job]  # its queue depth is looked at

    plan = plan_resends([job], Observed(missing=set(), idle_models=set()))  # queue not empty

    assert plan.send == [] and plan.hand_back == [] and plan.forget == set()
    assert plan.confirm == ["a"] and plan.resent == 0


def test_row_6_a_job_a_worker_took_is_only_confirmed() -> None:
    plan = plan_resends(
        [single("a"), line("l")], Observed(missing=set(), idle_models={"m"}, delivered={"a", "l"})
    )

    assert plan.send == [] and plan.hand_back == [] and plan.forget == set()
    assert plan.confirm == ["a", "l"]


def test_row_7_a_message_that_is_nowhere_is_forgotten_and_sent_again() -> None:
    job, lost_line = single("a"), line("l")

    plan = plan_resends([job, lost_line], Observed(missing=set(), idle_models={"m"}, delivered={"other"}))

    assert plan.forget == {"a", "l"}  # the markers that lied
    assert plan.send == [job] and plan.hand_back == ["l"]
    assert plan.confirm == ["a"] and plan.resent == 2


def test_row_7_only_for_the_models_whose_queue_is_empty() -> None:
    idle, busy = single("a", model="idle"), single("b", model="busy")

    plan = plan_resends([idle, busy], Observed(missing=set(), idle_models={"idle"}, delivered=set()))

    assert plan.forget == {"a"} and plan.send == [idle]
    assert plan.confirm == ["a", "b"]


def test_a_job_whose_marker_is_gone_is_not_also_counted_as_vanished() -> None:
    job = single("a")
    assert vanish_candidates([job], {"a"}) == []

    plan = plan_resends([job], Observed(missing={"a"}, idle_models={"m"}, delivered=set()))

    assert plan.forget == set() and plan.send == [job]


def test_row_8_an_old_delivery_of_a_queued_job_is_dropped_with_its_marker() -> None:
    deliveries = {"t1": ["a"], "t2": ["b", "c"], "t3": ["running"]}

    plan = plan_unclaimed(deliveries, queued={"a", "c"}, requeued=set())

    assert plan.tags == ["t1", "t2"]  # a chunk with one queued line is dropped whole
    assert plan.forget == {"a", "c"} and plan.count == 2


def test_row_8_then_row_4_the_dropped_job_is_sent_again_once_old() -> None:
    unclaimed = plan_unclaimed({"t": ["a"]}, queued={"a"}, requeued=set())
    # The marker is gone now: the next look finds row 4.
    plan = plan_resends([single("a")], Observed(missing=set(unclaimed.forget)))

    assert [job.job_id for job in plan.send] == ["a"]


def test_row_9_a_running_jobs_old_delivery_is_left_alone() -> None:
    plan = plan_unclaimed({"t": ["running"]}, queued=set(), requeued=set())

    assert plan.tags == [] and plan.forget == set() and plan.count == 0


def test_row_10_a_delivery_of_a_job_just_requeued_is_dropped_uncounted() -> None:
    plan = plan_unclaimed({"t1": ["expired"], "t2": ["a"]}, queued={"expired", "a"}, requeued={"expired"})

    assert plan.tags == ["t1", "t2"] and plan.forget == {"expired", "a"}
    assert plan.count == 1  # the re-queued one is counted as re-queued, not unclaimed


def test_rows_10_and_11_a_released_single_job_is_row_1_a_released_line_row_2() -> None:
    """Released jobs come back with `enqueued_at` null: the single job is listed as never
    sent and sent at once; a line is not listed (the feeder's), so nothing is planned."""
    plan = plan_resends([single("released", never_sent=True)], Observed(missing=set()))

    assert [job.job_id for job in plan.send] == ["released"]
    assert plan_resends([], Observed(missing=set())).resent == 0


def test_nothing_stale_nothing_done() -> None:
    plan = plan_resends([], Observed(missing=set()))

    assert (plan.send, plan.hand_back, plan.confirm, plan.forget) == ([], [], [], set())
    assert plan_unclaimed({}, set(), set()).tags == []
