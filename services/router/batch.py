"""Several generations answered as one response (completions with a list of prompts): their deltas merged into
one stream, prompt i's choices numbered i*n..i*n+n-1 as OpenAI numbers them, usage summed."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Optional

from tandem.services.router.gateway import Gateway
from tandem.services.router.messages import ChoiceDelta, GenerationSpec, TokenRequest, Usage
from tandem.services.router.openai_protocol import prompt_logprobs_entries

_DONE = object()


@asynccontextmanager
async def generate_all(gateway: Gateway, specs: list[GenerationSpec], reqs: list[TokenRequest]):
    """(deltas, usage, prompt_logprobs()) over all the generations; a single one passes straight through.
    prompt_logprobs() gives each choice index its prompt's entries once they have arrived (None when not
    asked for). Leaving the block cancels whatever is still running."""
    n = specs[0].sampling.n
    async with AsyncExitStack() as stack:
        parts = [await stack.enter_async_context(gateway.generate(spec, req)) for spec, req in zip(specs, reqs)]
        usages = [usage for _, usage in parts]

        def prompt_logprobs() -> Optional[dict[int, list]]:
            if not specs[0].prompt_logprobs:
                return None
            text = gateway.generator.assets.token_text
            return {i * n + j: prompt_logprobs_entries(req.input_ids, usage.prompt_logprobs, text,
                                                      specs[0].prompt_top_logprobs)
                    for i, (req, usage) in enumerate(zip(reqs, usages)) for j in range(n)}

        if len(parts) == 1:
            yield parts[0][0], usages[0], prompt_logprobs
            return
        total = Usage()
        merged = _merge([deltas for deltas, _ in parts], n, usages, total)
        try:
            yield merged, total, prompt_logprobs
        finally:
            await merged.aclose()


async def _merge(streams: list[AsyncIterator[ChoiceDelta]], n: int, usages: list[Usage],
                 total: Usage) -> AsyncIterator[ChoiceDelta]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(offset: int, deltas: AsyncIterator[ChoiceDelta], usage: Usage) -> None:
        try:
            async for delta in deltas:
                delta.index += offset
                total.weight_version = total.weight_version or usage.weight_version
                await queue.put(delta)
            await queue.put(_DONE)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i * n, s, u)) for i, (s, u) in enumerate(zip(streams, usages))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _sum_usage(usages, total)


def _sum_usage(usages: list[Usage], total: Usage) -> None:
    total.prompt_tokens = sum(u.prompt_tokens for u in usages)
    total.completion_tokens = sum(u.completion_tokens for u in usages)
    total.cached_tokens = sum(u.cached_tokens for u in usages)

