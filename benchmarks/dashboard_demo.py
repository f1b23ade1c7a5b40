#!/usr/bin/env python
"""The /dashboard page in headless Chromium while a workload runs: saves screenshots.

Starts ``pagedllm serve --enable-dashboard --enable-prefix-caching`` (or uses --base-url), sends
--num-prompts streamed completions sharing a prefix, opens /dashboard in headless Chromium
(Debian's ``chromium`` + ``chromium-driver``, driven by Selenium) and saves a screenshot while
they run and one after they finished.

    python benchmarks/dashboard_demo.py --out-dir benchmarks/results/dashboard
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1400"]


def chromium_missing() -> str:
    """Why headless Chromium cannot be driven here ("" when it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium; in the dev extra)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no chromium binary (apt-get install chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no chromedriver (apt-get install chromium-driver)"
    return ""


def chromium_driver(user_data_dir: str):
    """Headless Chromium under Selenium with a fresh profile; the local chromedriver (Selenium
    Manager would try to download one)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={user_data_dir}"]:
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service(executable_path=shutil.which("chromedriver")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), "--enable-dashboard",
           "--enable-prefix-caching", *extra]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def send_workload(base_url: str, n: int, max_tokens: int, headers: dict) -> threading.Thread:
    """n streamed completions sharing a prompt prefix, all at once, on a background thread."""
    import httpx

    def one(i: int) -> None:
        body = {"prompt": "ROMEO: " * 24 + f"request {i}", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=headers, timeout=600) as r:
            for _ in r.iter_lines():
                pass

    def run() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server with --enable-dashboard (default: start one)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--out-dir", default="benchmarks/results/dashboard")
    ap.add_argument("server_args", nargs="*", help="after --: flags for pagedllm serve")
    args = ap.parse_args()
    why = chromium_missing()
    if why:
        raise SystemExit(f"cannot drive Chromium: {why}")
    proc = None
    base = args.base_url
    if base is None:
        port = free_port()
        proc = start_server(port, args.server_args or ["--kv-cache-memory", "8MiB"])
        base = f"http://127.0.0.1:{port}"
    os.makedirs(args.out_dir, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    page = base.replace("://", f"://user:{args.api_key}@", 1) if args.api_key else base
    try:
        with tempfile.TemporaryDirectory() as profile:
            driver = chromium_driver(profile)
            try:
                driver.get(page + "/dashboard")
                work = send_workload(base, args.num_prompts, args.max_tokens, headers)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not driver.find_elements("css selector", 'tr[data-state="running"]'):
                    time.sleep(0.2)
                time.sleep(1.5)
                running = os.path.join(args.out_dir, "dashboard-running.png")
                driver.save_screenshot(running)
                print("screenshot:", running, "-", driver.find_element("id", "running-count").text)
                work.join(600)
                time.sleep(2)
                done = os.path.join(args.out_dir, "dashboard-finished.png")
                driver.save_screenshot(done)
                print("screenshot:", done, "-", driver.find_element("id", "running-count").text)
            finally:
                driver.quit()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
