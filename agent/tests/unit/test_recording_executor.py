"""The recording executor (mechanisms/queues/executor.py), the one `make run` and the journal-backed agent use: it
runs an item once per idempotency key, recorded in a SQLite journal with what ran and when, and answers DUPLICATE
for a key it has already run, also after a restart and also when two deliveries of one key run side by side. Time
is a ManualClock: the stand-in work waits on it, and the journal records its wall time."""

import asyncio
import json
import sqlite3

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.mechanisms.queues.executor import Outcome, RecordingExecutor


def rows(journal):
    db = sqlite3.connect(str(journal))
    try:
        return db.execute("SELECT idempotency_key, item_id, payload, executed_at, deliveries FROM executions "
                          "ORDER BY item_id").fetchall()
    finally:
        db.close()


def test_a_key_runs_once_recorded_with_what_ran_and_when_and_its_redelivery_is_a_duplicate_also_after_a_restart(
        tmp_path):
    journal = tmp_path / "journal.db"
    clock = ManualClock(start=5000.0)

    async def scenario():
        ex = RecordingExecutor(journal, clock=clock)
        first = await ex.execute(WorkItem(7, "job-b", {"z": 1, "a": [2]}, "l", 3))
        other = await ex.execute(WorkItem(2, "job-a", {}, "l", 1))
        again = await ex.execute(WorkItem(9, "job-b", {"changed": True}, "l2", 4))
        keys = ex.executed_keys()
        assert await ex.after_ack(WorkItem(7, "job-b", {}, "l", 3)) is None
        ex.close()
        return first, other, again, keys

    first, other, again, keys = asyncio.run(scenario())
    assert (first, other, again) == (Outcome.EXECUTED, Outcome.EXECUTED, Outcome.DUPLICATE)
    assert keys == ["job-a", "job-b"]  # in item order, each key once
    assert rows(journal) == [("job-a", 2, "{}", 5000.0, 1), ("job-b", 7, '{"a": [2], "z": 1}', 5000.0, 3)]

    async def restarted():
        ex = RecordingExecutor(journal, clock=clock)
        try:
            return await ex.execute(WorkItem(7, "job-b", {}, "l", 5)), ex.executed_keys()
        finally:
            ex.close()

    assert asyncio.run(restarted()) == (Outcome.DUPLICATE, ["job-a", "job-b"])


def test_a_recorded_key_is_answered_a_duplicate_at_once_without_the_stand_in_work(tmp_path):
    clock = ManualClock()

    async def scenario():
        ex = RecordingExecutor(tmp_path / "journal.db", clock=clock)
        await ex.execute(WorkItem(1, "done", {}, "l", 1))
        ex.work_seconds = 30.0
        task = asyncio.ensure_future(ex.execute(WorkItem(1, "done", {}, "l2", 2)))
        for _ in range(500):  # the journal's calls run on threads: until it ends or waits on the clock
            if task.done() or clock.sleepers:
                break
            await asyncio.sleep(0.01)
        waited = clock.sleepers
        await clock.advance(30.0)
        ex.close()
        return waited, await task

    assert asyncio.run(scenario()) == ([], Outcome.DUPLICATE)


def test_a_journal_that_cannot_be_opened_stops_the_start_naming_it_and_the_flag_that_moves_it(tmp_path):
    from gpu_agent.foundations.config import ConfigError

    (tmp_path / "a-file").write_text("")
    try:
        RecordingExecutor(tmp_path / "a-file" / "journal.db")
    except ConfigError as e:
        assert str(e).startswith(f"executor journal {tmp_path / 'a-file' / 'journal.db'} cannot be opened"), str(e)
        assert str(e).endswith("point --executor-journal at a writable file"), str(e)
    else:
        raise AssertionError("a journal under a file was opened")


def test_the_stand_in_work_waits_on_the_clock_and_a_key_recorded_meanwhile_makes_the_later_one_a_duplicate(tmp_path):
    clock = ManualClock()

    async def scenario():
        ex = RecordingExecutor(tmp_path / "journal.db", work_seconds=30.0, clock=clock)
        one = asyncio.ensure_future(ex.execute(WorkItem(1, "same", {}, "l", 1)))
        two = asyncio.ensure_future(ex.execute(WorkItem(1, "same", {}, "l-again", 2)))
        for _ in range(500):  # the journal's reads run on threads: until both work, waiting on the clock
            if len(clock.sleepers) == 2:
                break
            await asyncio.sleep(0.01)
        assert clock.sleepers == [30.0, 30.0] and not one.done() and not two.done()
        await clock.advance(29.0)
        assert not one.done() and not two.done() and ex.executed_keys() == []  # not recorded before the work ends
        await clock.advance(1.0)
        outcomes = sorted([await one, await two])
        recorded = rows(tmp_path / "journal.db")
        ex.close()
        return outcomes, recorded

    outcomes, recorded = asyncio.run(scenario())
    assert outcomes == sorted([Outcome.EXECUTED, Outcome.DUPLICATE])  # both checked before either recorded
    assert len(recorded) == 1 and recorded[0][3] == 1030.0  # recorded when the work ended, once


def test_without_work_seconds_nothing_waits_and_without_a_clock_the_system_clock_records_the_time(tmp_path):
    import time

    clock = ManualClock()

    async def scenario():
        ex = RecordingExecutor(tmp_path / "a.db", clock=clock)
        task = asyncio.ensure_future(ex.execute(WorkItem(1, "quick", {}, "l", 1)))
        for _ in range(500):  # the journal's calls run on threads: until it ends or waits on the clock
            if task.done() or clock.sleepers:
                break
            await asyncio.sleep(0.01)
        assert clock.sleepers == [] and task.done()
        outcome = await task
        ex.close()
        system = RecordingExecutor(tmp_path / "b.db")
        before = time.time()
        await system.execute(WorkItem(1, "wall", {}, "l", 1))
        system.close()
        return outcome, before

    outcome, before = asyncio.run(scenario())
    assert outcome == Outcome.EXECUTED and clock.sleepers == []
    assert before <= rows(tmp_path / "b.db")[0][3] <= time.time()
    assert json.loads(rows(tmp_path / "a.db")[0][2]) == {}
