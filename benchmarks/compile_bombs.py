"""Issue 29's per-request cost classes against a live server: each bomb's status, time and the
server's RSS before/after, then how long an unrelated 1-token request and /tokenize take while
eight regex compiles (abandoned by their clients after 3 s) run.

The server is built in this process (``build_app`` on the embedded default model, default limits);
RSS is this front-end process's, where tokenization, validation and the grammar compiles run (the
engine core has its own process unless PAGEDLLM_ENGINE_CORE_PROCESS=0).

    python benchmarks/compile_bombs.py --json benchmarks/results/compile_bombs.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(n)]


def bombs() -> dict:
    chat = "/v1/chat/completions"
    return {
        "10000 tools, required": ({"messages": [{"role": "user", "content": "hi"}], "tools": tools(10000),
                                   "tool_choice": "required", "max_tokens": 4}, chat),
        "1 MB guided_choice": ({"prompt": "a", "max_tokens": 2, "guided_choice": ["z" * (1 << 20)]}, None),
        "100k-value enum": ({"prompt": "a", "max_tokens": 2,
                             "guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}, None),
        "array nested 900 deep": ({"prompt": "a", "max_tokens": 2, "guided_json": json.loads(
            '{"type":"array","items":' * 900 + "{}" + "}" * 900)}, None),
        "n 128 x prompt_logprobs 20": ({"prompt": list(range(3, 503)), "max_tokens": 1, "n": 128,
                                        "prompt_logprobs": 20}, None),
    }


def start_server(model: str):
    import uvicorn

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    app = build_app(EngineConfig(model=model, served_model_name="tiny", max_model_len=512, kv_cache_memory=64 << 20))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while app.state.server.serving is None:
        time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(REPO, "models", "tiny-shakespeare"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import httpx

    load_before = os.getloadavg()
    server, url = start_server(args.model)

    def post(body, route=None, timeout=300):
        return httpx.post(url + (route or "/v1/completions"), json={"model": "tiny", **body}, timeout=timeout)

    post({"prompt": "a", "max_tokens": 1, "guided_choice": ["warm", "up"]})  # grammar backend built
    rows = []
    for name, (body, route) in bombs().items():
        r0, t0 = rss_mib(), time.perf_counter()
        r = post(body, route)
        err = r.json().get("error", {}) if r.status_code >= 400 else {}
        rows.append({"request": name, "status": r.status_code, "seconds": round(time.perf_counter() - t0, 2),
                     "rss_mib": f"{r0:.0f} -> {rss_mib():.0f}", "error": str(err.get("message", ""))[:70]})

    def abandoned_regex(i: int) -> str:
        pattern = "(" + "|".join(f"w{i}x{j}" for j in range(500)) + ")+"
        try:
            post({"prompt": "a", "max_tokens": 1, "guided_regex": pattern}, timeout=3)
            return "answered"
        except httpx.TimeoutException:
            return "abandoned"

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(abandoned_regex, i) for i in range(8)]
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = post({"prompt": "To be", "max_tokens": 1})
        rows.append({"request": "1-token completion during 8 regex compiles", "status": r.status_code,
                     "seconds": round(time.perf_counter() - t0, 2)})
        t0 = time.perf_counter()
        r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "hello"}, timeout=300)
        rows.append({"request": "/tokenize during 8 regex compiles", "status": r.status_code,
                     "seconds": round(time.perf_counter() - t0, 2)})
        clients = [f.result() for f in futures]
    server.should_exit = True
    print_table(rows, ["request", "status", "seconds", "rss_mib", "error"])
    print("regex clients:", clients, f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    write_json(args.json, {"rows": rows, "regex_clients": clients,
                           "loadavg_before": load_before, "loadavg_after": os.getloadavg()})


if __name__ == "__main__":
    main()
