"""``LoopTurns``: at most ``per_turn`` callers pass in one turn of the event loop, in arrival
order, and a caller cancelled while it waits gives its place to the next."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from dllm.server.turns import LoopTurns


def _passes(n: int, per_turn: int, cancel: set[int] = frozenset()) -> list[tuple[int, int]]:
    """(caller, turn it passed in) for ``n`` callers that all ask in the same turn."""

    async def main() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        turn = itertools.count()
        now = [0]

        def tick() -> None:  # runs once every turn of the loop
            now[0] = next(turn)
            loop.call_soon(tick)

        tick()
        turns, passed = LoopTurns(per_turn), []

        async def caller(i: int) -> None:
            await turns.take()
            passed.append((i, now[0]))

        tasks = [asyncio.create_task(caller(i)) for i in range(n)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # every caller has asked; those past the budget wait
        for i in cancel:
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return passed

    return asyncio.run(main())


def _per_turn(passes: list[tuple[int, int]]) -> list[int]:
    return [len(list(g)) for _, g in itertools.groupby(t for _, t in passes)]


@pytest.mark.parametrize("n,per_turn", [(9, 2), (7, 3), (4, 1)])
def test_callers_pass_in_order_a_few_per_turn(n, per_turn):
    passes = _passes(n, per_turn)
    assert [i for i, _ in passes] == list(range(n))
    full, rest = divmod(n, per_turn)
    assert _per_turn(passes) == [per_turn] * full + ([rest] if rest else [])


def test_a_cancelled_waiter_gives_its_place_on():
    # 5 is still queued when cancelled: the others pass as if it never asked.
    passes = _passes(7, 2, cancel={5})
    assert [i for i, _ in passes] == [0, 1, 2, 3, 4, 6]
    assert _per_turn(passes) == [2, 2, 2]
    # 3 was already woken (its turn had come): its place goes to the next one, nobody is
    # left waiting and no turn has more than its budget.
    passes = _passes(6, 2, cancel={3})
    assert [i for i, _ in passes] == [0, 1, 2, 4, 5]
    assert max(_per_turn(passes)) == 2


def test_per_turn_must_be_positive():
    with pytest.raises(ValueError, match="per_turn must be at least 1"):
        LoopTurns(0)
