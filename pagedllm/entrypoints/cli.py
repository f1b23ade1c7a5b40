"""The ``pagedllm`` command: ``pagedllm generate`` (offline) and ``pagedllm serve`` (OpenAI server).

Engine flags are derived from EngineConfig's fields. Imports stay lazy: parsing flags loads
neither torch nor transformers, so ``pagedllm serve`` answers HTTP quickly.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import json
import re
import sys
from typing import Optional, Sequence

from pagedllm import envs
from pagedllm.config import (EngineConfig, default_model_path, runs_on_cpu, serve_default_max_num_seqs,
                             serve_default_max_num_seqs_per_request)
from pagedllm.config import parse_size as config_parse_size
from pagedllm.entrypoints.http_guard import HTTP_CHOICES, LOOP_CHOICES

_HELP = {
    "tokenizer": "tokenizer directory (default: the model's)",
    "runner": "auto (pooling for encoder / classifier architectures), generate, or pooling (embeddings, /score, "
              "/rerank)",
    "dtype": "weights and KV cache dtype: auto (from the checkpoint), float32, bfloat16, float16",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype), fp8_e4m3 (alias fp8), fp8_e5m2 or int8; the 8-bit "
                      "dtypes keep a bf16 scale per token and kv head and hold ~2x the tokens of a bf16 cache",
    "quantization": "weight quantization: default detected from config.json quantization_config (gptq, awq, "
                    "compressed-tensors, fp8); int8 or fp8 on an unquantized checkpoint quantize it at load, per "
                    "output channel",
    "device": "auto, cpu, cuda or cuda:N",
    "seed": "global random seed",
    "block_size": "tokens per KV cache block (a power of two)",
    "kv_cache_memory": "KV cache budget per rank, in bytes or with a unit (512MiB, 2GiB); overrides "
                       "--cpu-memory-utilization / --gpu-memory-utilization (default: sized from the memory "
                       "available)",
    "cpu_memory_utilization": "CPU: fraction of the memory available to the process after loading the weights "
                              "(MemAvailable, cgroup limits respected; shared by the tensor-parallel ranks on one "
                              "host) that the KV cache and one step's activations may use (default 0.5)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights + activations + KV cache)",
    "num_gpu_blocks_override": "use exactly this many KV cache blocks",
    "max_num_seqs": "most requests in one batch (default 256; `serve` on CPU: 128, a bound on the time per "
                    "output token at saturation)",
    "max_num_batched_tokens": "token budget of one step",
    "max_model_len": "context length (prompt + output); default: the model's max_position_embeddings, lowered "
                     "to what the KV cache holds (an explicit value that does not fit is an error)",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps",
    "tensor_parallel_size": "number of tensor parallel ranks",
    "pipeline_parallel_size": "pipeline parallel stages (layers split across them; each stage may be tensor "
                              "parallel: world = pipeline x tensor parallel size)",
    "pp_layer_partition": "decoder layers per pipeline stage, e.g. 6,6 (default: an even split, the remainder to "
                          "the first stages; env PAGEDLLM_PP_LAYER_PARTITION)",
    "distributed_executor_backend": "how tensor-parallel ranks run: mp (processes on this machine; default) or ray "
                                    "(actors placed across an existing Ray cluster; pip install 'pagedllm[ray]')",
    "served_model_name": "the model name clients use (default: the model path)",
    "max_waiting_requests": "sequences (n per request) that may wait beyond the running batch; past it new requests "
                            "get 429 with Retry-After (default: 4 x max_num_seqs)",
    "max_n": "most sequences (n) one request may ask for (default 128)",
    "max_num_seqs_per_request": "most sequences of one request (n, best_of) running at once; the rest wait their "
                                "turn while other requests are scheduled (default: `serve` max_num_seqs / 4; "
                                "offline all of max_num_seqs)",
    "max_pooling_inputs": "most inputs one pooling request may carry (/v1/embeddings, /pooling inputs, /score pairs, "
                          "/rerank documents; default 2048); more is a 400",
    "max_pooling_tokens": "most tokens over all the inputs of one pooling request (default 1048576); more is a 400",
    "max_pooling_output_values": "most numbers one pooling reply may carry (token_embed: a vector per token; default "
                                 "8388608, or one max_model_len input's token vectors if more); more is a 400",
    "generation_config": "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                         "max_new_tokens) for requests that leave them unset: auto (the model's "
                         "generation_config.json), vllm (ignore it), or a directory holding a generation_config.json",
    "cpu_kernels": "use pagedllm's C++ CPU kernels (built for this CPU on first use; env PAGEDLLM_DISABLE_CPU_KERNELS=1 "
                   "turns the default off); --no-cpu-kernels runs the pure-torch paths",
    "native_decode": "run a decode-only step of a Llama-shaped model with every layer in one native call, on the "
                     "same kernels (identical outputs); env PAGEDLLM_NATIVE_DECODE=0 turns the default off",
    "cpu_gemm": "CPU linear layers per weight shape: auto (pagedllm's packed GEMM or oneDNN's, whichever this CPU "
                "runs faster, timed at start-up and cached per CPU), pagedllm, or onednn; env PAGEDLLM_CPU_GEMM",
    "kernel_cache_dir": "where built CPU kernels are cached (default: $PAGEDLLM_CACHE_DIR/kernels or ~/.cache/pagedllm/kernels)",
    "cpu_keep_freed_memory": "let glibc malloc keep freed activations for reuse (faster steps; resident memory stays "
                             "at its peak); env PAGEDLLM_CPU_KEEP_FREED_MEMORY=0 turns the default off",
    "cpu_kv_cache_prefault": "fault the CPU KV cache's pages in at start-up (as a torch.zeros cache is) instead of at "
                             "each block's first write: slower start-up, no first-touch cost while serving",
    "cpu_kv_cache_idle_prefault": "without --cpu-kv-cache-prefault: fault in the pages of the CPU KV cache's lowest "
                                  "blocks (the first handed out), up to this size, while the engine has nothing to do "
                                  "(default 1GiB; 0 turns it off; a request waits at most one 2 MiB slice)",
    "cpu_threads": "torch threads per rank on CPU (default: all cores with one rank, cores / ranks with tensor "
                   "parallelism, or the bound CPUs' count; env PAGEDLLM_THREADS_PER_RANK)",
    "cpu_threads_adapt": "on CPU, drop to one intra-op thread while the cores are oversubscribed (run-queue waits) "
                         "and go back once they are free (default on; off with an explicit --cpu-threads)",
    "cpu_threads_bind": "bind each rank's threads to CPUs: nobind, auto (the allowed CPUs split evenly across "
                        "ranks) or explicit lists per rank such as 0-3|4-7 (env PAGEDLLM_CPU_THREADS_BIND)",
    "speculative_config": "speculative decoding as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} or {\"method\": \"draft_model\", "
                          "\"model\": DIR, \"num_speculative_tokens\": 3} or {\"method\": \"eagle\", \"model\": "
                          "EAGLE_HEAD_DIR, \"num_speculative_tokens\": 3}; optional disable_by_batch_size, "
                          "auto_disable (default true: decode plainly while speculation measurably loses)",
    "logits_processors": "custom logits processors (vLLM's interface): qualified names of LogitsProcessor "
                         "subclasses, package.module:Class, loaded at start-up and applied to every step's logits",
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model, mixed in one batch",
    "max_loras": "LoRA adapter slots: distinct adapters that can run at once (others wait for a slot)",
    "max_lora_rank": "the largest LoRA rank accepted (slots are sized for it)",
    "max_cpu_loras": "LoRA adapters kept read in host memory per worker, least recently used dropped (default "
                     "max_loras)",
    "max_loras_per_step": "most distinct LoRA adapters in one step (default max_loras)",
    "kv_offloading_size": "KV offload tier size in GiB (summed over tensor-parallel ranks): KV blocks evicted from "
                          "the cache are kept there and loaded back on a prefix hit instead of recomputed (default "
                          "off)",
    "kv_offloading_backend": "the KV offload tier's store: native (host memory; pinned on GPU) or disk (files under "
                             "--kv-offload-dir)",
    "kv_offload_dir": "directory of the disk KV offload tier's block files (--kv-offloading-backend disk or "
                      "native+disk)",
    "kv_offload_host_size": "--kv-offloading-backend native+disk: GiB of host memory (summed over tensor-parallel "
                            "ranks) in front of the disk tier (--kv-offloading-size); its least recently used blocks "
                            "spill to disk",
    "allowed_local_media_path": "a directory whose image files prompts may name (a path or file:// URL in an "
                                "image_url part); default none",
    "allowed_media_domains": "hosts whose http(s) image URLs in image_url parts the server fetches (exact, "
                             "case-insensitive host names; a subdomain is its own entry); default none: every "
                             "remote image URL is a 400. Redirects are followed only to these hosts",
    "media_fetch_timeout": "seconds one remote image fetch may take, redirects and body included (default 5)",
    "media_fetch_max_bytes": "the largest remote image body, in bytes or as 20MiB (default 20MiB); a larger one is "
                             "stopped while it is read",
    "limit_mm_per_prompt": "most images a prompt may carry, as JSON: {\"image\": 4} (default 16)",
}
_SKIP = {"model"}
def parse_size(text: str) -> int:
    try:
        return config_parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1073741824, 512MiB, 2GiB)") from None


def _field_type(f: dataclasses.Field):
    t = str(f.type)
    if f.name in ("kv_cache_memory", "media_fetch_max_bytes", "cpu_kv_cache_idle_prefault"):
        return parse_size
    for name, conv in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if re.search(rf"\b{name}\b", t):
            return conv
    return str


class _GivenOnce(argparse.Action):
    """A flag that may be given once: a second value is an error, not a silent replacement."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier != values:
            parser.error(f"{option_string} given twice ({earlier} and {values}): a server serves one model")
        setattr(namespace, self.dest, values)


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """One flag per EngineConfig field (``--max-model-len`` for ``max_model_len``)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        conv = _field_type(f)
        help_ = _HELP.get(f.name, f.name.replace("_", " "))
        if conv is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name in ("logits_processors", "allowed_media_domains"):
            group.add_argument(flag, dest=f.name, nargs="+", default=None,
                               metavar="CLASS" if f.name == "logits_processors" else "HOST", help=help_)
        else:
            group.add_argument(flag, dest=f.name, type=conv, default=None, help=help_)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if f.name == "served_model_name" and isinstance(value, list):  # serve takes several: the first is reported
            value = value[0] if value else None
        if value is not None:
            kwargs[f.name] = value
    if not kwargs.get("model"):
        kwargs["model"] = default_model_path()
    return EngineConfig(**kwargs)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV-cache LLM inference and serving.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("prompt", nargs="*", help="prompts (default: read one prompt per line from stdin)")
    gen.add_argument("--model", default=None, help="model directory (default: the embedded tiny-shakespeare)")
    unset = " (default: the model's generation_config.json, else %s)"
    gen.add_argument("--max-tokens", type=int, default=None, help="tokens to generate" + unset % 64)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy" + unset % 1.0)
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling" + unset % 1.0)
    gen.add_argument("--top-k", type=int, default=None, help="top-k sampling, 0 = off" + unset % 0)
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_engine_args(gen, exclude=("seed",))

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("model_pos", metavar="MODEL", nargs="?", default=None,
                     help="model directory (default: the embedded tiny-shakespeare)")
    srv.add_argument("--model", default=None, action=_GivenOnce, help="model directory (same as MODEL; one model a "
                     "server)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env PAGEDLLM_API_KEY)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
    srv.add_argument("--skip-tokenizer-init", action="store_true",
                     help="serve a checkpoint without tokenizer files: token-id prompts only, no text in outputs")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds to let in-flight requests finish; then each open one ends with an "
                          "error (an error event and [DONE] for streams)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="allow a chat_template in requests (rendered in a separate process, bounded in time, "
                          "memory and output); off by default: such requests get 400")
    srv.add_argument("--chat-template", default=None,
                     help="a chat template (a file, or the template itself) replacing the model's; requests may "
                          "pass variables to it in chat_template_kwargs")
    srv.add_argument("--chat-template-timeout", type=float, default=2.0,
                     help="seconds a request's chat template may take to render (default 2)")
    srv.add_argument("--max-request-body-size", type=parse_size, default=None,
                     help="largest request body, in bytes or with a unit (8MiB); larger ones get 413 (default: "
                          "4 MiB above the largest prompt max_model_len can hold)")
    srv.add_argument("--http-read-timeout", type=float, default=30.0,
                     help="seconds a client may take to send a request's headers, and between parts of its body "
                          "(then the connection is closed, or 408); default 30")
    srv.add_argument("--request-timeout", type=float, default=None,
                     help="default deadline of a request in seconds (a request's 'timeout' field or x-request-timeout "
                          "header overrides it); past it the request is aborted with 408 (default: none)")
    srv.add_argument("--metrics-prefix", default="pagedllm",
                     help="prefix of the /metrics names (PREFIX:num_requests_running ...); 'vllm' makes vLLM's "
                          "dashboards work unchanged")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters to serve (needs --enable-lora): name=path, or a JSON object "
                          '{"name": ..., "path": ..., "base_model_name": ...}; a request\'s model picks one')
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser')
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    srv.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                     help="how tool_choice \"auto\" reads tool calls out of the model's output")
    srv.add_argument("--enable-dashboard", action="store_true",
                     help="serve GET /dashboard: a live page of the running/waiting requests, the KV cache's block "
                          "map and the step times (behind --api-key: a browser gives the key as the password)")
    _add_vllm_serve_flags(srv)
    srv.add_argument("--data-parallel-size", type=int, default=1,
                     help="engine replicas behind this server: N child servers on internal ports, each pinned to "
                          "its share of the CPUs (or its own GPUs), and a prefix-aware router on --port")
    from pagedllm.entrypoints.router.server import add_router_args, add_router_parser

    add_router_args(srv)
    add_engine_args(srv, exclude=("served_model_name",))  # several names: _add_vllm_serve_flags
    add_router_parser(sub)
    from pagedllm.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    return parser


def _json_list(text: str) -> list[str]:
    """vLLM's list flags take JSON (``'["*"]'``); a plain word is a one-item list."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return value
    return [text]


def _structured_outputs_config(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or value.get("backend", "auto") not in ("auto", "xgrammar") or set(value) - {"backend"}:
        raise argparse.ArgumentTypeError('only {"backend": "auto"} or {"backend": "xgrammar"} (the one backend here)')
    return value


def _add_vllm_serve_flags(srv: argparse.ArgumentParser) -> None:
    """vLLM's serve flags (docs/usage.md, *vLLM's serve flags*)."""
    g = srv.add_argument_group("vLLM-compatible")
    g.add_argument("--served-model-name", dest="served_model_name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may use (all routable; the first is the one reported)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's own log level")
    g.add_argument("--uvicorn-loop", default="auto", choices=list(LOOP_CHOICES),
                   help="the event loop: auto = uvloop when installed (the default install has it), else asyncio")
    g.add_argument("--uvicorn-http", default="auto", choices=list(HTTP_CHOICES),
                   help="the HTTP/1.1 parser: auto = httptools when installed (the default install has it), else h11")
    g.add_argument("--enable-log-requests", action="store_true", help="log one line per request (id, prompt "
                   "length, sampling parameters)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput/queue log line")
    g.add_argument("--max-logprobs", type=int, default=20, help="most logprobs/top_logprobs/prompt_logprobs a request "
                   "may ask for (0..20; default 20)")
    g.add_argument("--allowed-origins", type=_json_list, default=None,
                   help="CORS: origins browsers may call from, a JSON list ('[\"*\"]') or one origin; default: no "
                        "CORS headers")
    g.add_argument("--allowed-methods", type=_json_list, default=None, help='CORS methods (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=None, help='CORS headers (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this app under")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (with --ssl-certfile): serve HTTPS")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required")
    g.add_argument("--response-role", default="assistant", help="the role of chat replies (default assistant)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /openapi.json either (the /docs pages are never served)")
    g.add_argument("--override-generation-config", default=None,
                   help='JSON over the model\'s generation_config.json defaults, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted: no checkpoint code is ever run here (only the built-in architectures load)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors"],
                   help="weights format: safetensors (the only one; auto means it)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a thinking model's <think>...</think> reasoning into reasoning_content")
    g.add_argument("--structured-outputs-config", type=_structured_outputs_config, default=None,
                   help='{"backend": "xgrammar"} (or "auto"): the one structured-outputs backend here')


def sub_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (``serve``) of the ``pagedllm`` parser."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            print("pagedllm generate: give prompts as arguments or on stdin", file=sys.stderr)
            return 2
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "max_tokens": args.max_tokens}
    params = SamplingParams(**{"max_tokens": 64, **llm.engine.default_sampling_params,
                               **{k: v for k, v in given.items() if v is not None},
                               "n": args.n, "seed": args.sampling_seed})
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if len(prompts) > 1 or args.n > 1:
            print(f"=== prompt {i}: {prompt!r}")
        for o in out.outputs:
            if args.n > 1:
                print(f"--- completion {o.index} ({o.finish_reason})")
            print(prompt + o.text if not args.chat else o.text)
    return 0


def _bench_llm(args: argparse.Namespace):
    """The offline engine of ``pagedllm bench throughput|latency``: the engine flags, --seed."""
    from pagedllm.entrypoints.llm import LLM

    config = dataclasses.replace(engine_config_from_args(args), seed=args.seed)
    return LLM(**dataclasses.asdict(config))


def _catch_stop_signals():
    """Until the server installs its handlers, remember SIGTERM/SIGINT instead of dying, so a
    stop during start-up is still a graceful one (exit 0). Returns "was one received?"."""
    import signal

    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: got.append(s))
    return lambda: bool(got)


def _warm_engine_imports() -> None:
    """Start importing torch and the model code on a side thread while the web stack loads."""
    import threading

    def work() -> None:
        try:
            import pagedllm.worker.worker  # noqa: F401  (torch, models, attention)
        except Exception:  # the engine loader will report it
            pass

    threading.Thread(target=work, name="pagedllm-warm-imports", daemon=True).start()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from pagedllm.version import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    import logging

    level = getattr(args, "log_level", "warning").upper()
    if args.command == "serve":  # every line names the HTTP request it belongs to ("-": none)
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
        from pagedllm.entrypoints.request_id import RequestIdFilter

        for handler in logging.getLogger().handlers:
            handler.addFilter(RequestIdFilter())
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("generate", "serve") and runs_on_cpu(getattr(args, "device", None)):
            from pagedllm.worker.cpu_threads import apply_omp_environment

            apply_omp_environment()  # before torch loads: libgomp reads it once (ranks and replicas inherit it)
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from pagedllm.bench.cli import run_bench

            return run_bench(args, argv, _bench_llm, sub_parser(parser, "bench"))
        if args.command == "router":
            from pagedllm.entrypoints.router.server import run_router_command

            # a stop before uvicorn takes over, and the one it re-raises after its graceful stop: exit 0
            return run_router_command(args, _catch_stop_signals())
        args.stop_requested = _catch_stop_signals()
        from pagedllm.entrypoints.router.data_parallel import watch_parent

        watch_parent()  # a data-parallel replica: SIGTERM when its launcher dies
        if args.model and args.model_pos and args.model != args.model_pos:
            print(f"pagedllm serve: error: two models given ({args.model_pos} and --model {args.model}): a server "
                  "serves one model", file=sys.stderr)
            return 2
        args.model = args.model or args.model_pos
        served_names = list(args.served_model_name or ())  # --served-model-name a b: all routable
        if not args.model and not args.served_model_name:  # the embedded default model
            args.served_model_name = os.path.basename(default_model_path())
        if args.max_num_seqs is None:  # on CPU a smaller running batch (config.CPU_SERVE_MAX_NUM_SEQS)
            args.max_num_seqs = serve_default_max_num_seqs(args.device)
        if args.max_num_seqs_per_request is None:  # a server's clients share the batch (offline: all slots)
            args.max_num_seqs_per_request = serve_default_max_num_seqs_per_request(args.max_num_seqs)
        config = engine_config_from_args(args)
        if args.data_parallel_size != 1:
            if args.data_parallel_size < 1:
                raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
            from pagedllm.entrypoints.router.data_parallel import run_data_parallel

            return run_data_parallel(config, args, sub_parser(parser, "serve"))
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            from pagedllm.executor.multiproc import launched_as_worker_rank, serve_as_worker_rank

            if launched_as_worker_rank():  # torchrun rank > 0: no HTTP, just the model shard's steps
                serve_as_worker_rank(config)
                return 0
        from pagedllm.entrypoints.openai.api_server import ServerArgs, run_server

        server_args = ServerArgs(host=args.host, port=args.port, api_key=args.api_key or envs.api_key(),
                                 log_level=args.log_level, access_log=args.access_log,
                                 shutdown_timeout=args.shutdown_timeout, skip_tokenizer_init=args.skip_tokenizer_init,
                                 trust_request_chat_template=args.trust_request_chat_template,
                                 chat_template_timeout=args.chat_template_timeout, chat_template=args.chat_template,
                                 max_request_body_size=args.max_request_body_size,
                                 http_read_timeout=args.http_read_timeout, request_timeout=args.request_timeout,
                                 metrics_prefix=args.metrics_prefix, lora_modules=tuple(args.lora_modules or ()),
                                 allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                                 enable_auto_tool_choice=args.enable_auto_tool_choice,
                                 tool_call_parser=args.tool_call_parser,
                                 enable_dashboard=args.enable_dashboard,
                                 served_model_names=tuple(served_names),
                                 uvicorn_log_level=args.uvicorn_log_level, uvicorn_loop=args.uvicorn_loop,
                                 uvicorn_http=args.uvicorn_http, enable_log_requests=args.enable_log_requests,
                                 disable_log_stats=args.disable_log_stats, max_logprobs=args.max_logprobs,
                                 allowed_origins=tuple(args.allowed_origins or ()),
                                 allowed_methods=tuple(args.allowed_methods or ("*",)),
                                 allowed_headers=tuple(args.allowed_headers or ("*",)),
                                 allow_credentials=args.allow_credentials, root_path=args.root_path,
                                 ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                 ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                                 response_role=args.response_role, disable_fastapi_docs=args.disable_fastapi_docs,
                                 override_generation_config=args.override_generation_config,
                                 reasoning_parser=args.reasoning_parser)
        from pagedllm.entrypoints.http_guard import listen_socket

        sock = listen_socket(server_args.host, server_args.port)  # a bad host or a busy port: one line
        # only now (no error exit can race it): a process leaving while this thread is inside
        # torch's C++ start-up aborts ("terminate called without an active exception", 134)
        _warm_engine_imports()
        return run_server(config, server_args, args.stop_requested, sock=sock)
    except ValueError as e:  # bad configuration: one clear line, no traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
