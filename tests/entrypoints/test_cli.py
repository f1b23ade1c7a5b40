"""The ``pagedllm`` command: generate, serve flags, graceful SIGTERM, and a start-up without transformers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import free_port
from processes import children, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_prints_text(llama_ckpt, capsys):
    from pagedllm.entrypoints.cli import main
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    rc = main(["generate", "w1 w2 w3", "--model", llama_ckpt, "--max-tokens", "5", "--temperature", "0",
               "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    llm = LLM(model=llama_ckpt, kv_cache_memory=16 << 20, max_model_len=256, dtype="float32")
    ref = llm.generate(["w1 w2 w3"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.strip() == ("w1 w2 w3" + ref.outputs[0].text).strip()
    rc = main(["generate", "w1", "w2", "--model", llama_ckpt, "--max-tokens", "3", "--n", "2", "--seed", "1",
               "--kv-cache-memory", "16MiB", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("=== prompt") == 2 and out.count("--- completion") == 4


def test_engine_flags_come_from_engine_config(llama_ckpt):
    import dataclasses

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.cli import _build_parser, engine_config_from_args, parse_size

    args = _build_parser().parse_args([
        "serve", llama_ckpt, "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--block-size", "8", "--kv-cache-memory", "8MiB", "--gpu-memory-utilization", "0.5", "--dtype", "bfloat16",
        "--no-enable-prefix-caching", "--max-waiting-requests", "3", "--tensor-parallel-size", "1", "--seed", "5",
        "--served-model-name", "m"])
    args.model = args.model or args.model_pos
    cfg = engine_config_from_args(args)
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == \
        (llama_ckpt, 128, 8, 64, 8)
    assert cfg.kv_cache_memory == 8 << 20 and cfg.gpu_memory_utilization == 0.5 and cfg.dtype == "bfloat16"
    assert cfg.enable_prefix_caching is False and cfg.max_waiting_requests == 3 and cfg.seed == 5
    assert cfg.served_model_name == "m"
    flags = {a.dest for a in _build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags | {"model"}
    assert parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000 and parse_size("1.5k") == 1500


def test_serve_bad_model_exits_2(tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "model must be a local directory" in capsys.readouterr().err


def test_serve_two_models_are_checked_before_anything_starts(tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    # two models make a multi-model server; a missing one is refused at once, naming it
    assert main(["serve", "--model", str(tmp_path / "a"), "--model", str(tmp_path / "b")]) == 2
    assert f"no such model: '{tmp_path / 'a'}'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b")]) == 2
    assert "no such model" in capsys.readouterr().err


def _serve(model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
           "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not become ready"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def _stream_started(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed completion of ``max_tokens`` on a thread, returned once its first chunk is in;
    its lines land in the dict's "lines" when it ends."""
    first_chunk, result = threading.Event(), {"lines": []}

    def stream():
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    result["lines"].append(line)
                    first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(30)
    return t, result


def test_sigterm_finishes_in_flight_and_exits_0(llama_ckpt):
    proc, url = _serve(llama_ckpt, "--served-model-name", "tiny")
    try:
        t, result = _stream_started(url, 60)
        cores = children(proc.pid, "spawn_main")  # not multiprocessing's resource tracker
        assert len(cores) == 1, "the engine core runs in a process of its own"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        t.join(30)
        assert not wait_gone(cores, 5), "the engine core process outlived the server"
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"  # the in-flight request was finished, not cut
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert sum(1 for c in chunks for ch in c["choices"]) == 60
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_engine_core_ends_the_server_with_status_1(llama_ckpt):
    """A supervisor restarts only a process that exits: once the engine core dies, the open
    stream gets its error event and [DONE], and the server exits 1."""
    proc, url = _serve(llama_ckpt, "--served-model-name", "tiny")
    try:
        t, result = _stream_started(url, 200)
        cores = children(proc.pid, "spawn_main")
        assert len(cores) == 1
        os.kill(cores[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        t.join(30)
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]" or json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == "length"
        if lines[-1] == "data: [DONE]" and "error" in lines[-2]:
            assert json.loads(lines[-2][6:])["error"]["code"] == "engine_dead"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_aborts_requests_past_the_shutdown_timeout(llama_ckpt):
    """Past --shutdown-timeout an open stream ends with an error event and [DONE] (not cut), a
    new request meanwhile gets 503 shutting_down, and no traceback is logged."""
    # The stream must still be running when the drain ends, on a fast quiet machine too: 1000
    # tokens cannot be generated within a 0.1 s drain (a 250-token stream once finished in 0.5 s).
    proc, url = _serve(llama_ckpt, "--shutdown-timeout", "0.1", "--max-model-len", "1024")
    try:
        started, result = threading.Event(), {"lines": []}

        def stream():
            body = {"prompt": "w1", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line:
                            result["lines"].append(line)
                        started.set()
            except httpx.HTTPError as e:
                result["error"] = e

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 < 15
        t.join(30)
        lines = result["lines"]
        assert "error" not in result and lines[-1] == "data: [DONE]", result
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_start_imports_no_transformers(llama_ckpt):
    """Start-up speed: building the engine for a plain checkpoint must not import transformers
    (seconds of imports); see benchmarks/startup.py for the wall-clock measurement."""
    code = (
        "import sys; from pagedllm.engine.async_llm import AsyncLLM; from pagedllm.config import EngineConfig; "
        f"e = AsyncLLM(EngineConfig(model={llama_ckpt!r}, kv_cache_memory=16 << 20)); "
        "import pagedllm.entrypoints.openai.api_server; "
        "print('transformers' in sys.modules, 'sympy' in sys.modules); e.shutdown()"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_serve_on_cpu_runs_at_most_128_sequences_unless_told(llama_ckpt, monkeypatch):
    """`pagedllm serve` on CPU defaults max_num_seqs to config.CPU_SERVE_MAX_NUM_SEQS (a bound on the
    time per output token at saturation); --max-num-seqs wins; the offline default stays 256."""
    import pagedllm.entrypoints.openai.api_server as api_server
    from pagedllm.config import CPU_SERVE_MAX_NUM_SEQS, EngineConfig, serve_default_max_num_seqs
    from pagedllm.entrypoints.cli import main

    import logging

    import pagedllm.entrypoints.cli as cli

    seen = []

    def fake_run_server(config, server_args, stop, sock=None):
        if sock is not None:  # the CLI binds before loading anything; the stub never serves on it
            sock.close()
        seen.append(config)
        return 0

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    monkeypatch.setattr(cli, "_catch_stop_signals", lambda: (lambda: False))  # pytest keeps its handlers
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    assert main(["serve", llama_ckpt, "--device", "cpu"]) == 0
    assert main(["serve", llama_ckpt, "--device", "cpu", "--max-num-seqs", "300"]) == 0
    assert [c.max_num_seqs for c in seen] == [CPU_SERVE_MAX_NUM_SEQS, 300] and CPU_SERVE_MAX_NUM_SEQS == 128
    assert EngineConfig(model=llama_ckpt).max_num_seqs == 256  # LLM / offline
    assert serve_default_max_num_seqs("cuda") == serve_default_max_num_seqs("cuda:1") == 256
