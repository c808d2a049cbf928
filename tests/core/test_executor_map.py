"""An all-reduce's executor map that is dropped mid-stream is closed without asyncio logging a destroyed task (the
fix ``finish_abandoned_executor_maps``; ``pytest --without-patch finish_abandoned_executor_maps`` fails it)."""

import asyncio
import gc
import logging

import pytest
from hivemind.averaging import allreduce
from hivemind.utils.asyncio import as_aiter


async def endless_numbers():
    value = 0
    while True:
        yield value
        value += 1


async def failing_after(count):
    async for value in as_aiter(*range(count)):
        yield value
    raise ConnectionResetError("stream reset")


async def breaks_when_cancelled():
    """One value, then a read that fails with the stream's error when cancelled, as a p2p stream read under
    ``asyncio.wait_for`` does when the stream broke at the moment of the cancellation."""
    yield 0
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        raise BrokenPipeError("the stream broke while the read was cancelled") from None


async def close_a_map_whose_producer_fails_on_cancellation() -> None:
    executor_map = allreduce.amap_in_executor(lambda value: value, breaks_when_cancelled())
    assert await executor_map.__anext__() == 0
    await asyncio.sleep(0.1)  # the producer waits for the next input
    await executor_map.aclose()


async def drop_a_started_map_in_a_reference_cycle() -> int:
    """Start a map over an endless stream, leave it (and its producer, blocked on the full queue) referred to only by
    a reference cycle, collect garbage; how many tasks besides this one are still running after that?"""
    executor_map = allreduce.amap_in_executor(lambda value: value * 2, endless_numbers(), max_prefetch=1)
    assert await executor_map.__anext__() == 0
    await asyncio.sleep(0.2)  # the producer fills the queue and waits
    cycle = {"map": executor_map}
    cycle["itself"] = cycle
    del executor_map, cycle
    gc.collect()
    await asyncio.sleep(0.2)  # the map's aclose, scheduled by its finalizer, cancels the producer
    return len(asyncio.all_tasks()) - 1


def forget_earlier_garbage(caplog) -> None:
    """Collect what earlier tests left (a pending task of another event loop logs "Task was destroyed" when it is
    collected), so that only this test's own tasks are judged."""
    gc.collect()
    caplog.clear()


async def collect(stream):
    return [value async for value in stream]


def test_dropped_map_cancels_its_producer_without_logging_an_error(caplog):
    forget_earlier_garbage(caplog)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert asyncio.run(drop_a_started_map_in_a_reference_cycle()) == 0
        gc.collect()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_closed_map_retrieves_the_error_its_producer_queued_while_cancelled(caplog):
    forget_earlier_garbage(caplog)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(close_a_map_whose_producer_fails_on_cancellation())
        gc.collect()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_map_yields_results_in_order_and_raises_what_its_input_raised():
    doubled = allreduce.amap_in_executor(lambda left, right: left + right, as_aiter(*range(5)), as_aiter(*range(5)))
    assert asyncio.run(collect(doubled)) == [0, 2, 4, 6, 8]
    with pytest.raises(ConnectionResetError, match="stream reset"):
        asyncio.run(collect(allreduce.amap_in_executor(lambda value: value, failing_after(3))))
