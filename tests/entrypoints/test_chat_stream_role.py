"""The chat stream's role chunk comes with the first output, not before prefill: a client that
starts its time-to-first-token clock at the first chunk (vLLM's benchmark client does) must not
see a chunk while the prompt is still being computed."""
import asyncio
import json

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving import OpenAIServing, ServingOptions
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.outputs import CompletionOutput, RequestOutput


class GatedStreams:
    """A StreamSet stand-in: its first output comes only once ``prefilled`` is set."""

    def __init__(self) -> None:
        self.prefilled = asyncio.Event()
        self.closed = False

    async def __aiter__(self):
        await self.prefilled.wait()
        yield 0, RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "hi", [5], None, None)], False)
        yield 0, RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "!", [6], None, None, "stop")], True)

    def close(self) -> None:
        self.closed = True


def test_role_chunk_waits_for_the_first_output():
    async def run():
        serving = OpenAIServing.__new__(OpenAIServing)  # the chat stream needs none of the engine's state
        serving.options = ServingOptions()
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
        streams = GatedStreams()
        gen = ServingChat(serving).stream(req, streams, "chatcmpl-1", "tiny", 2).__aiter__()
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a chunk was sent before the prompt was computed"
        streams.prefilled.set()
        chunks = [await first] + [c async for c in gen]
        return [json.loads(c[len("data: "):]) for c in chunks if c != "data: [DONE]\n\n"], streams

    chunks, streams = asyncio.run(run())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "hi!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and streams.closed
