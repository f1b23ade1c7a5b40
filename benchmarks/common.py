"""Shared benchmark helpers: the random-weight models and fixed-seed workloads (no model hub)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

MODELS = {
    "llama-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=688),
    "llama-100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                       intermediate_size=2048),
    # A TinyLlama-1.1B-shaped model: memory-bandwidth-bound decode (2.2 GB of bf16 weights).
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632),
    # Mixtral-shaped sparse MoE (MixtralForCausalLM): 8 experts, top 2; the -top1 / -16e variants
    # show step time following the active experts, not the total.
    "mixtral-moe": dict(arch="mixtral", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2),
    "mixtral-moe-top1": dict(arch="mixtral", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=4, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=1),
    "mixtral-moe-16e": dict(arch="mixtral", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, intermediate_size=1024, num_local_experts=16, num_experts_per_tok=2),
}
CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "bench-models")


def ensure_model(name: str) -> str:
    """Create (once) a bf16 random-weight LlamaForCausalLM (MixtralForCausalLM for the MoE
    entries), vocab 32000, seed 0."""
    path = os.path.join(CACHE_DIR, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers as tf

    fields = dict(MODELS[name])
    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[fields.pop("arch", "llama")]
    cfg = config_cls(vocab_size=32000, max_position_embeddings=4096, torch_dtype="bfloat16",
                     bos_token_id=1, eos_token_id=2, **fields)
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_workload(n: int, seed: int = 0, prompt_range=(64, 512), output_range=(32, 256), vocab: int = 32000):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        reqs.append(([rng.randrange(3, vocab) for _ in range(plen)], olen))
    return reqs


def cpu_info() -> dict:
    """The CPU this ran on and the C++ kernels' ISA level in this process (None where they are not
    loaded here, e.g. only in an engine process): pagedllm.kernels.cpu.describe()."""
    try:
        from pagedllm.kernels import cpu

        return cpu.describe()
    except Exception as e:  # a record without it beats no record
        return {"error": repr(e)}


def device_info(device: str) -> dict:
    """The accelerator a GPU figure came from (name, memory, SMs, torch / CUDA / Triton versions);
    {"device": "cpu"} for CPU runs, whose CPU is recorded under "cpu"."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "sms": props.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def write_json(path: str | None, data) -> None:
    """Write ``data`` (with the CPU and kernel level under "cpu" when it is a dict) as JSON."""
    if path:
        if isinstance(data, dict) and "cpu" not in data:
            data = {**data, "cpu": cpu_info()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max([len(c)] + [len(f"{r.get(c, '')}") for r in rows]) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths)))


BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def start_neighbours(n: int, seconds: float = 900) -> list[subprocess.Popen]:
    """N busy-loop processes on this process's CPUs (they inherit its affinity), each bounded in
    time: the competing load of a shared host."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=seconds)]) for _ in range(n)]


def stop_neighbours(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


class HealthProbe:
    """GET /health on one kept-alive connection, reopened after a failure: ``status()`` is the HTTP
    status, or None when the request failed (refused, reset, timed out)."""

    def __init__(self, base_url: str, timeout: float) -> None:
        host, port = base_url.split("//")[1].split(":")
        self._addr, self._timeout, self._conn = (host, int(port)), timeout, None

    def status(self):
        import http.client

        try:
            if self._conn is None:
                self._conn = http.client.HTTPConnection(*self._addr, timeout=self._timeout)
            self._conn.request("GET", "/health")
            r = self._conn.getresponse()
            r.read()
            return r.status
        except (OSError, http.client.HTTPException):
            self._conn = None
            return None
