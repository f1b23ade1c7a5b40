"""Start-up errors are one line an operator can act on and a non-zero exit (the traceback only
with --log-level debug); uvicorn's own answer to an unparseable request is our JSON error."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import LiveServer, free_port


def serve(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_startup_errors_are_one_line(llama_ckpt, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(os.path.join(llama_ckpt, "model.safetensors"), no_config)
    truncated = tmp_path / "truncated"
    shutil.copytree(llama_ckpt, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    small = ["--kv-cache-memory", "8MiB", "--max-model-len", "256"]
    busy = socket.socket()  # a port another process listens on
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = {  # name: (args, exit code, text the error line holds)
        "empty": ([str(empty)], 2, "has no config.json (it is empty)"),
        "no_config": ([str(no_config)], 2, "has no config.json"),
        "port": ([llama_ckpt, "--port", "99999"], 2, "port must be in 0..65535"),
        "truncated": ([str(truncated), "--port", str(free_port()), *small], 1, f"{weights} (corrupt or truncated?)"),
        "debug": ([str(truncated), "--port", str(free_port()), "--log-level", "debug", *small], 1, str(weights)),
        "port_in_use": ([llama_ckpt, "--port", str(busy.getsockname()[1]), *small], 2,
                        f"cannot listen on 127.0.0.1:{busy.getsockname()[1]}"),
        "bad_host": ([llama_ckpt, "--host", "256.1.1.1", "--port", str(free_port()), *small], 2,
                     "--host '256.1.1.1' is not an address"),
    }
    import torch

    if not torch.cuda.is_available():
        cases["cuda"] = ([llama_ckpt, "--device", "cuda", "--port", str(free_port()), *small], 1,
                         "no CUDA device is available")
    procs = {name: serve(*args) for name, (args, _, _) in cases.items()}  # in parallel: seconds, not tens
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        _, code, text = cases[name]
        assert proc.returncode == code, (name, err)
        lines = [line for line in err.splitlines() if text in line]
        if name == "debug":  # the error line, then the traceback (whose last line repeats it)
            assert "Traceback" in err and lines, (name, err)
        else:
            assert len(lines) == 1, (name, err)
            assert "Traceback" not in err, (name, err)
            errors = [line for line in err.splitlines() if "error" in line.lower()]
            assert errors == lines, (name, err)  # the one error line, nothing else alarming
    busy.close()


@pytest.mark.parametrize("http, loop", [("h11", "asyncio"), ("httptools", "uvloop")])
def test_each_http_parser_answers_unparseable_requests_with_json_400_and_closes_silent_sockets(server, http, loop):
    """Both parsers `--uvicorn-http` offers, each on its event loop: a request line neither can
    parse gets our JSON 400; a connection that never sends its headers is closed after
    http_read_timeout; an ordinary request is answered."""
    import importlib.util

    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    for module in (http, loop):
        if module not in ("h11", "asyncio") and importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    args = ServerArgs(uvicorn_http=http, uvicorn_loop=loop, http_read_timeout=1.0)
    live = LiveServer(build_app(server.engine, served_model_name="tiny", args=args), args=args)
    try:
        assert live.server.config.loop == loop
        assert any(c.__module__.endswith(f"{http}_impl") for c in live.server.config.http.__mro__)
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
            s.sendall(b"GARBAGE / HTTP/9\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_http" and err["type"] == "invalid_request_error"
        assert err["message"].startswith("invalid HTTP request")
        with socket.create_connection(("127.0.0.1", live.port)) as s:  # never sends its headers
            s.settimeout(10)
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed by the server
            assert time.monotonic() - t0 < 5
        # headers past the bound: refused (h11's own 400 comes first; httptools would buffer any size) and closed
        for size in (200_000, 3_000_000):
            r = httpx.get(live.url + "/v1/models", headers={"x-junk": "j" * size}, timeout=30)
            assert r.status_code in (400, 431) and r.json()["error"]["type"] == "invalid_request_error", r.text
        ok = httpx.get(live.url + "/v1/models", headers={"x-fine": "f" * 30_000}, timeout=30)
        assert ok.status_code == 200 or (http == "h11" and ok.status_code == 400)
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
    finally:
        live.stop()


@pytest.mark.parametrize("field, value", [("uvicorn_http", "http2"), ("uvicorn_loop", "trio")])
def test_unknown_http_parser_or_event_loop_is_refused_by_name(field, value):
    from pagedllm.entrypoints.openai.api_server import ServerArgs

    with pytest.raises(ValueError, match=field):
        ServerArgs(**{field: value})
