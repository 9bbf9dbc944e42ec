"""The engine driver's per-step hand-over to the event loop (:class:`~specpilot.serve.driver.LoopSink`): a coalescing
sink gets its request's first output, then one :class:`~specpilot.serve.driver.Coalesced` of every later token at
the end (one stamp per held step that committed tokens); a plain sink gets every step; both get the same tokens."""

from __future__ import annotations

import asyncio

from specpilot.engine.batch import Request
from specpilot.model.checkpoint import load_tokenizer
from specpilot.serve.driver import ADMITTED, Coalesced, EngineDriver, LoopSink
from specpilot.zoo import bundled_target_dir

from .serve_fake import FakeBatchEngine

TOK = load_tokenizer(bundled_target_dir())


async def _collect(driver, rid: str, max_new: int, coalesce: bool) -> list:
    queue: asyncio.Queue = asyncio.Queue()
    driver.submit(Request(request_id=rid, prompt_ids=[5, 6, 7], max_new_tokens=max_new),
                  LoopSink(asyncio.get_running_loop(), queue.put_nowait, coalesce))
    items = []
    while True:
        item = await asyncio.wait_for(queue.get(), 30)
        items.append(item)
        out = item.output if isinstance(item, Coalesced) else item
        if item != ADMITTED and out.finished:
            return items


def test_coalescing_sink_gets_first_output_then_the_rest_at_once():
    engine = FakeBatchEngine(TOK, eos_id=-1, num_slots=4)
    driver = EngineDriver(engine).start()

    async def both():
        return await asyncio.gather(_collect(driver, "plain", 20, False), _collect(driver, "held", 20, True))

    try:
        plain, held = asyncio.run(both())
    finally:
        driver.stop()
    assert plain[0] == held[0] == ADMITTED
    assert len(plain) > 3 and not any(isinstance(i, Coalesced) for i in plain)
    assert len(held) == 3 and isinstance(held[2], Coalesced)
    first, last = held[1], held[2]
    tokens = list(first.new_tokens) + list(last.output.new_tokens)
    assert tokens == [t for i in plain[1:] for t in i.new_tokens] == engine.expected(20)
    assert last.output.finished and last.output.finish_reason == "length"
    assert len(last.stamps) >= 1 and last.stamps == sorted(last.stamps)
    assert driver._held == {}
