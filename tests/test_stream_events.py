"""`stream_events` on its own: while a request's outputs are already queued (a fast engine, a slow
event loop) the stream still lets the event loop turn between outputs, so that the task listening for
a client's disconnect (and every other request's) runs before the request ends."""

import asyncio

from draftwise.engine.outputs import RequestMetrics, RequestOutput
from draftwise.server.metrics import ServerMetrics
from draftwise.server.streaming import StreamContext, stream_events

TOKENS = 50


def output(step: int) -> RequestOutput:
    done = step == TOKENS
    return RequestOutput("r", "p", [1], "x" * step, [7] * step, "length" if done else None,
                         RequestMetrics(1, step, 0.0, 0.0, 0.0 if done else None), delta="x", num_new_tokens=1)


async def queued_outputs():
    """What the engine's queue gives when it is ahead: every output at once, no pause between."""
    for step in range(2, TOKENS + 1):
        yield output(step)


def test_the_event_loop_turns_between_queued_outputs():
    async def run() -> tuple[int, int]:
        events, other_ran_after = [], []

        async def another_task():  # (scheduled before the stream starts: it runs at the first turn)
            other_ran_after.append(len(events))

        context = StreamContext("r", 0, "m", chat=False, include_usage=False, segment="other", method=None)
        stream = stream_events([output(1)], [queued_outputs()], context, ServerMetrics("m"))
        asyncio.get_running_loop().create_task(another_task())
        async for event in stream:  # (nothing here pauses either)
            events.append(event)
        return (other_ran_after[0] if other_ran_after else None), len(events)

    ran_after, total = asyncio.run(run())
    assert total > TOKENS and ran_after is not None and ran_after <= 3, (ran_after, total)
