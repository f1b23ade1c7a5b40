"""Live-server fixtures: uvicorn on 127.0.0.1 with a free port, in a background thread, over a
tiny random-weight checkpoint."""
from __future__ import annotations

import socket
import threading
import time

import pytest

ENGINE_KW = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """build_app(...) served by uvicorn on a thread; ``url`` is http://127.0.0.1:PORT."""

    def __init__(self, app, args=None) -> None:
        """``args``: a ServerArgs to serve with ``pagedllm serve``'s uvicorn settings (header
        timeouts, drain on stop) instead of plain uvicorn ones."""
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if args is not None:
            import dataclasses

            from pagedllm.entrypoints.openai.api_server import make_server

            self.server = make_server(app, dataclasses.replace(args, port=self.port, log_level="warning"))
        else:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                       timeout_keep_alive=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    @property
    def state(self):
        return self.app.state.server

    @property
    def engine(self):
        return self.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_live(config, args=None) -> LiveServer:
    """A LiveServer over build_app(config, args), once its engine has loaded (or fail)."""
    from pagedllm.entrypoints.openai.api_server import build_app

    return wait_ready(LiveServer(build_app(config, args=args) if args is not None else build_app(config)))


def serve_shared(server: LiveServer, args, **kw) -> LiveServer:
    """One more app, with ``args`` (a ServerArgs; uvicorn run with its settings), over the shared
    ``server``'s engine: no second model load. The app does not own the engine."""
    from pagedllm.entrypoints.openai.api_server import build_app

    return LiveServer(build_app(server.engine, served_model_name="tiny", args=args, **kw), args=args)


def make_engine(model: str, multiprocess: bool = True, **kw):
    """An AsyncLLM; ``multiprocess=False`` keeps the core in this process (for tests that patch
    its executor)."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_llm import AsyncLLM

    return AsyncLLM(EngineConfig(model=model, **{**ENGINE_KW, **kw}), multiprocess=multiprocess)


def wait_idle(engine, timeout: float = 20.0) -> None:
    """Until the engine holds no request and no KV block (or fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if engine.num_unfinished() == 0 and s.num_running == 0 and s.num_waiting == 0 \
                and s.num_free_blocks == s.num_total_blocks:
            return
        time.sleep(0.05)
    s = engine.stats
    raise AssertionError(f"engine not idle: pending={engine.num_unfinished()} stats={s}")


def wait_ready(live: LiveServer, handlers: str = "serving", timeout: float = 120) -> LiveServer:
    """Until the app's loader thread has built the engine (``state.serving``, or ``state.pooling``
    for a pooling model); a load error fails at once."""
    deadline = time.monotonic() + timeout
    while getattr(live.state, handlers) is None:
        assert live.state.load_error is None, live.state.load_error
        assert time.monotonic() < deadline, "engine did not load"
        time.sleep(0.05)
    return live


@pytest.fixture(scope="session")
def server(llama_ckpt):
    """The shared server: engine built by the app's loader thread from an EngineConfig."""
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app

    app = build_app(EngineConfig(model=llama_ckpt, served_model_name="tiny", **ENGINE_KW))
    live = wait_ready(LiveServer(app))
    yield live
    live.stop()


@pytest.fixture(scope="session")
def offline(llama_ckpt):
    """The offline LLM over the same checkpoint and settings (the reference for greedy outputs)."""
    from pagedllm.entrypoints.llm import LLM

    return LLM(model=llama_ckpt, **ENGINE_KW)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
