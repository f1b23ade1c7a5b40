"""Fake ``pagedllm serve`` backends for router tests: small FastAPI apps on uvicorn threads that
record what they were sent, stream on cue, and can be stopped and restarted on their port."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornThread:
    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    timeout_keep_alive=5, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakeBackend:
    """One fake replica. ``gate``: streams send their first chunk, then wait for it."""

    def __init__(self, name: str, port: int = 0) -> None:
        self.name = name
        self.received: list[dict] = []
        self.auth: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.die_mid_stream = False
        self.port = port or free_port()
        self.server = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.server = UvicornThread(self._app(), self.port)

    def stop(self) -> None:
        self.server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "base", "object": "model", "owned_by": self.name}]}

        @app.get("/metrics")
        async def metrics():
            n = len(self.received)
            text = ("# HELP pagedllm:prompt_tokens_total Prompt tokens.\n# TYPE pagedllm:prompt_tokens_total counter\n"
                    f'pagedllm:prompt_tokens_total{{model_name="base"}} {10 * n}\n'
                    "# HELP pagedllm:num_requests_running Running.\n# TYPE pagedllm:num_requests_running gauge\n"
                    f'pagedllm:num_requests_running{{model_name="base"}} {n}\n')
            return Response(text, media_type="text/plain; version=0.0.4")

        async def answer(raw: Request):
            body = await raw.json()
            self.received.append(body)
            self.auth.append(raw.headers.get("authorization", ""))
            if body.get("model") == "unauthorized":
                return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"}}, status_code=401)
            if not body.get("stream"):
                return {"backend": self.name, "object": "text_completion"}

            async def events():
                yield f"data: {json.dumps({'backend': self.name, 'i': 0})}\n\n"
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
                if self.die_mid_stream:
                    raise RuntimeError("replica dies mid-stream")
                yield f"data: {json.dumps({'backend': self.name, 'i': 1})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        app.post("/v1/completions")(answer)
        app.post("/v1/chat/completions")(answer)
        return app
