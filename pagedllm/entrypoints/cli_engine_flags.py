"""The engine flags of the ``pagedllm`` subcommands: one flag per EngineConfig field
(``--max-model-len`` for ``max_model_len``), their help texts, and the EngineConfig read back
from the parsed flags. Parsing them loads neither torch nor transformers."""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Sequence

from pagedllm.config import EngineConfig, default_model_path
from pagedllm.config import parse_size as config_parse_size

ENGINE_FLAG_HELP = {
    "tokenizer": "tokenizer directory (default: the model's)",
    "runner": "auto (pooling for encoder / classifier architectures), generate, or pooling (embeddings, /score, "
              "/rerank)",
    "dtype": "weights and KV cache dtype: auto (from the checkpoint), float32, bfloat16, float16",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype; bfloat16 for a GGUF file on CPU, as llama.cpp "
                      "keeps f16), float32, bfloat16 (also under a float32 model: half the bytes per token), fp8_e4m3 (alias fp8), fp8_e5m2 or int8; the 8-bit "
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


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """One flag per EngineConfig field (``--max-model-len`` for ``max_model_len``)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        conv = _field_type(f)
        help_ = ENGINE_FLAG_HELP.get(f.name, f.name.replace("_", " "))
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
        if f.name == "model" and isinstance(value, list):  # serve's --model may be given per model
            if len(set(value)) > 1:
                raise ValueError(f"one engine serves one model, got {len(value)}: {value}")
            value = value[0] if value else None
        if value is not None:
            kwargs[f.name] = value
    if not kwargs.get("model"):
        kwargs["model"] = default_model_path()
    return EngineConfig(**kwargs)
