"""Engine configuration: frozen, validated dataclasses. CLI flags are derived from these."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from pagedllm import envs

# The scheduler's policies (pagedllm/core/scheduling_policy.py registers one class per name).
SCHEDULING_POLICIES = ("fcfs", "priority")

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight quantization (pagedllm/quantization/): checkpoint formats, and int8/fp8 quantized at load.
QUANTIZATION_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "int8", "gguf")
# KV cache storage (attention/kv_quant.py): "fp8" is an alias of "fp8_e4m3".
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# The KV offload tier's stores (worker/kv_tier/): "native" host memory, "disk" files, "native+disk" host
# memory spilling to files.
KV_OFFLOADING_BACKENDS = ("native", "disk", "native+disk")


def default_model_path() -> str:
    """The embedded default model shipped in the repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "models", "tiny-shakespeare")


_SPEC_METHODS = ("ngram", "draft_model", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``speculative_config`` as a dict or JSON text): ``method`` "ngram"
    (prompt lookup: the tokens that followed the last earlier occurrence of the sequence's final
    n-gram, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), "draft_model" (a
    smaller ``model`` with the same vocabulary) or "eagle" (an EAGLE-1 head ``model`` over the
    target's last hidden states, spec_decode/eagle.py); ``num_speculative_tokens`` drafts per step,
    verified in one target forward; ``disable_by_batch_size``: no drafts in steps whose running
    batch is at least this large; ``auto_disable``: decode plainly while the measured costs say
    speculation loses."""

    method: str
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 0
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None
    auto_disable: bool = True  # decode plainly while measured step costs say speculation loses (spec_decode/governor.py)

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {_SPEC_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in 1..16, got "
                             f"{self.num_speculative_tokens}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
            if self.prompt_lookup_max == 0:
                object.__setattr__(self, "prompt_lookup_max", max(self.prompt_lookup_min, 3))
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        elif not self.model or not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError("speculative_config.model must be a checkpoint directory with a config.json for "
                             f"method {self.method!r}, got {self.model!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value) -> Optional["SpeculativeConfig"]:
        """A SpeculativeConfig from itself, a dict, or JSON text (the CLI flag); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(names)}")
        if "method" not in value:
            raise ValueError("speculative_config.method is required ('ngram', 'draft_model' or 'eagle')")
        return cls(**value)


DEFAULT_IMAGES_PER_PROMPT = 16


def _names_gguf(model: str) -> bool:
    """A .gguf file, or a folder without a config.json holding a .gguf file (models/gguf.py's
    find_gguf_file says which, or that several are one too many)."""
    if os.path.isfile(model):
        return model.lower().endswith(".gguf")
    return (os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json"))
            and any(f.lower().endswith(".gguf") for f in os.listdir(model)))


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default_factory=default_model_path)
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    quantization: Optional[str] = None  # None: from config.json quantization_config; int8/fp8 quantize at load
    kv_cache_dtype: str = "auto"  # auto (the model dtype; bfloat16 for GGUF on CPU), float32, bfloat16, fp8_e4m3 (alias fp8), fp8_e5m2, int8
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes; None: sized from cpu_memory_utilization / gpu_memory_utilization
    cpu_memory_utilization: float = 0.5  # CPU: fraction of the available host memory for KV cache + activations
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # default max(2048, max_model_len) without chunking
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # pipeline stages (world = pipeline_parallel_size x tensor_parallel_size)
    # decoder layers per pipeline stage ("6,6" or [6, 6]); None: an even split
    pp_layer_partition: Optional[tuple] = field(default_factory=envs.pp_layer_partition)
    distributed_executor_backend: Optional[str] = None  # "mp" (processes on this machine; default) or "ray"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (no effect on CPU)
    served_model_name: Optional[str] = None
    max_waiting_requests: Optional[int] = None  # sequences waiting beyond max_num_seqs; default 4 x max_num_seqs
    max_n: int = 128  # most sequences (n) one request may ask for
    # most of one request's sequences (n / best_of children) running at once; the others wait their turn,
    # so a large-n request never holds every slot (None: max_num_seqs; `serve` sets max_num_seqs // 4)
    max_num_seqs_per_request: Optional[int] = None
    generation_config: str = "auto"  # "auto": the model's generation_config.json; "vllm": ignore it; or a directory
    # CPU settings (defaults may be overridden by the variables listed in envs.py).
    cpu_kernels: bool = field(default_factory=envs.cpu_kernels_enabled)
    # the engine core (scheduler, KV cache, model) in a process of its own, the HTTP front end in the other; None:
    # the server's default (its own process) and LLM's (one process)
    engine_core_process: Optional[bool] = field(default_factory=envs.engine_core_process)
    # a decode-only step of a Llama-shaped model: every layer in one native call (models/decode_stack.py)
    native_decode: bool = field(default_factory=envs.native_decode)
    kernel_cache_dir: str = field(default_factory=envs.kernel_cache_dir)
    cpu_keep_freed_memory: bool = field(default_factory=envs.cpu_keep_freed_memory)
    cpu_kv_cache_prefault: bool = False  # fault the KV cache's pages in at start-up, not at first write (worker/cpu_memory.py)
    # else: fault in the lowest blocks' pages, up to this many bytes, while the engine idles (0: off)
    cpu_kv_cache_idle_prefault: int = 1 << 30
    cpu_threads: Optional[int] = field(default_factory=envs.cpu_threads)
    cpu_threads_bind: Optional[str] = field(default_factory=envs.cpu_threads_bind)
    # one intra-op thread while the cores are oversubscribed (worker/cpu_threads.ThreadGovernor);
    # never with an explicit cpu_threads
    cpu_threads_adapt: bool = field(default_factory=envs.cpu_threads_adapt)
    # linear layers' GEMM per weight shape: "auto" (pagedllm's or oneDNN's, timed at start-up and cached
    # per CPU: layers/gemm_select.py), "pagedllm" or "onednn"
    cpu_gemm: str = field(default_factory=envs.cpu_gemm)
    speculative_config: Optional[SpeculativeConfig] = None  # a dict or JSON text is parsed into one
    # LoRA adapters (PEFT format) served beside the base weights, mixed in one batch
    enable_lora: bool = False
    max_loras: int = 1  # adapter slots: distinct adapters that can run at once
    max_lora_rank: int = 16  # the largest adapter rank accepted (slots are sized for it)
    max_cpu_loras: Optional[int] = None  # adapters kept read in host memory per worker (default max_loras)
    max_loras_per_step: Optional[int] = None  # most distinct adapters in one step (default max_loras)
    # "pooling": embeddings / scores / rerank (worker/pooling_runner.py) instead of generation;
    # "auto": pooling for encoder and classifier architectures (BertModel, ...), else generate
    runner: str = "auto"
    max_registered_loras: int = 1024  # adapter names the engine knows at once (loaded at run time or named)
    # What one output constraint may cost (structured_output/limits.py): over a limit is a 400 naming it
    structured_max_bytes: int = 64 << 10  # a constraint's text (JSON schema, regex, grammar, all choices)
    structured_max_depth: int = 64  # nesting of a JSON schema's objects and arrays
    structured_max_alternatives: int = 1024  # entries of one enum / anyOf / oneOf, or choices
    structured_compile_workers: int = 2  # grammar compile threads (a pool of their own)
    structured_max_queued_compiles: int = 16  # compiles waiting beyond the workers (more: 429)
    structured_compile_timeout: float = 10.0  # seconds a request waits for its compile (408 past it)
    structured_cache_bytes: int = 64 << 20  # compiled grammars kept (one cache: the engine core's), by memory_size_bytes
    # "thread": compiles on the compile threads (bounded up front by the limits above; a started one cannot be
    # stopped); "process": in worker processes of their own, killed past structured_compile_timeout or when nobody
    # waits any more (structured_output/compile_process.py; each worker holds xgrammar + torch, ~270 MiB)
    structured_compile_isolation: str = "thread"
    structured_compile_memory: int = 1 << 30  # bytes one compile worker's heap may grow by (more: 400)
    max_tools: int = 128  # tools one chat request may carry (OpenAI's limit)
    # logprob entries (token x top-N alternatives, over n choices and prompts) one response may carry:
    # prompt_logprobs x n, echo x logprobs x prompt length, logprobs x max_tokens x n (more: 400)
    max_logprob_entries: int = 500_000
    # What one pooling request (/v1/embeddings, /pooling, /score, /rerank) may carry (more: 400 naming the limit):
    max_pooling_inputs: int = 2048  # inputs (texts or token id lists; /score pairs, /rerank documents)
    max_pooling_tokens: int = 1 << 20  # tokens over all its inputs (2048 inputs of a 512-token encoder)
    # numbers in its reply (token_embed: one vector per token); None: 8M (~170 MB of JSON), or more where one
    # max_model_len input's token vectors need it (every input that fits is answerable alone)
    max_pooling_output_values: Optional[int] = None
    # the scheduler's queue order and preemption victim (core/scheduling_policy.py): "fcfs" (arrival order) or
    # "priority" (by Request.priority, lower first, then arrival; vLLM's rule)
    scheduling_policy: str = "fcfs"
    # The KV offload tier (core/kv_tier.py, worker/kv_tier/): blocks evicted from the KV cache are kept in a
    # larger, slower store and loaded back on a prefix hit instead of recomputed. Off (None) by default.
    kv_offloading_size: Optional[float] = None  # GiB, summed over the tensor-parallel ranks (vLLM's meaning)
    kv_offloading_backend: str = "native"  # "native": host memory (pinned on GPU); "disk": files under kv_offload_dir
    kv_offload_dir: Optional[str] = None  # the disk tier's directory (kv_offloading_backend "disk" / "native+disk")
    # "native+disk": GiB of host memory (summed over the tensor-parallel ranks) in front of the disk tier
    # (kv_offloading_size): the most recently stored blocks stay there, the least recently used spill to disk
    kv_offload_host_size: Optional[float] = None
    # a directory whose image files prompts may name (a path or file:// URL; vLLM's --allowed-local-media-path);
    # None: no local files.
    allowed_local_media_path: Optional[str] = None
    # hosts whose http(s) image URLs the server fetches (vLLM's --allowed-media-domains): exact, case-insensitive
    # host names (a subdomain is another entry); () (the default): every remote image URL is refused. A list, or
    # text with the names separated by commas or spaces; kept lower-case as a tuple once checked.
    allowed_media_domains: tuple = ()
    media_fetch_timeout: float = 5.0  # seconds one remote image may take, redirects and body included (vLLM: 5)
    media_fetch_max_bytes: int = 20 << 20  # a larger remote image body is stopped while it is read (or "20MiB")
    # most images one prompt may carry, vLLM's --limit-mm-per-prompt: {"image": N} (or its JSON text); default 16.
    # Kept as ((modality, limit), ...) once checked.
    limit_mm_per_prompt: Optional[object] = None
    # vLLM's --async-scheduling: the core schedules step N+1 while step N runs, the tokens N is still
    # sampling standing in as placeholders the worker fills in itself (engine/core.py); a step with a
    # beam search or a constrained request running goes one at a time
    async_scheduling: bool = False
    # vLLM's custom logits processors (sample/logits_processors.py): LogitsProcessor subclasses, by qualified
    # name ("package.module:Class") or as classes, built on the sampling rank and applied to every step's logits
    logits_processors: tuple = ()

    def _check_kv_offloading(self) -> None:
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {list(KV_OFFLOADING_BACKENDS)}, got "
                             f"{self.kv_offloading_backend!r}")
        size = self.kv_offloading_size
        backend = self.kv_offloading_backend
        if self.kv_offload_dir and (size is None or backend not in ("disk", "native+disk")):
            raise ValueError(f"kv_offload_dir is the disk tier's directory: it needs kv_offloading_backend 'disk' or "
                             f"'native+disk' (got {backend!r}) and a kv_offloading_size"
                             + ("" if size is not None else " (none given)"))
        if size is None:
            if self.kv_offload_host_size is not None:
                raise ValueError("kv_offload_host_size is the host part of the KV offload tier: it needs "
                                 "kv_offloading_size and kv_offloading_backend 'native+disk'")
            return
        if not 0 < size < float("inf"):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size: the KV offload tier keys blocks by their prefix-cache hash; it "
                             "needs enable_prefix_caching")
        if self.pipeline_parallel_size > 1:
            raise ValueError("kv_offloading_size: the KV offload tier does not support pipeline_parallel_size > 1 "
                             "yet")
        if self.distributed_executor_backend == "ray":
            raise ValueError("kv_offloading_size: the KV offload tier does not support "
                             "distributed_executor_backend='ray' yet")
        spec = self.speculative_config
        if spec is not None and spec.method in ("draft_model", "eagle"):
            raise ValueError(f"kv_offloading_size: the KV offload tier does not keep a draft model's cache; "
                             f"speculative_config method {spec.method!r} is not supported with it yet (use 'ngram')")
        if backend in ("disk", "native+disk") and not self.kv_offload_dir:
            raise ValueError(f"kv_offloading_backend {backend!r} needs kv_offload_dir (a directory for the block files)")
        host = self.kv_offload_host_size
        if backend == "native+disk" and (host is None or not 0 < host < float("inf")):
            raise ValueError("kv_offloading_backend 'native+disk' needs kv_offload_host_size, a positive number of GiB "
                             f"of host memory in front of the disk tier, got {host}")
        if backend != "native+disk" and host is not None:
            raise ValueError(f"kv_offload_host_size is the host part of kv_offloading_backend 'native+disk', not "
                             f"{backend!r}")

    def _check_pipeline_parallel(self) -> None:
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
        part = self.pp_layer_partition if pp > 1 else None
        if isinstance(part, str):
            try:
                part = [int(x) for x in part.replace(" ", "").split(",") if x]
            except ValueError:
                raise ValueError(f"pp_layer_partition must be comma-separated layer counts like '6,6', got "
                                 f"{self.pp_layer_partition!r}") from None
        if part is not None:
            part = tuple(int(x) for x in part)
            if len(part) != pp:
                raise ValueError(f"pp_layer_partition {list(part)} has {len(part)} stages but pipeline_parallel_size "
                                 f"is {pp}")
            if min(part) < 1:
                raise ValueError(f"pp_layer_partition {list(part)}: every stage needs at least 1 layer")
        object.__setattr__(self, "pp_layer_partition", part if pp > 1 else None)
        if pp == 1:
            return
        if self.speculative_config is not None:
            raise ValueError("speculative decoding (speculative_config) does not support pipeline_parallel_size > 1 "
                             "yet")
        if self.enable_lora:
            raise ValueError("LoRA (enable_lora) does not support pipeline_parallel_size > 1 yet")

    @property
    def max_images_per_prompt(self) -> int:
        return dict(self.limit_mm_per_prompt).get("image", DEFAULT_IMAGES_PER_PROMPT)

    def _parse_mm_limits(self) -> None:
        value = self.limit_mm_per_prompt
        if value is None:
            value = {}
        if isinstance(value, tuple):  # already parsed (dataclasses.replace)
            value = dict(value)
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"limit_mm_per_prompt must be JSON like '{{\"image\": 4}}', got {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"limit_mm_per_prompt must be a dict like {{'image': 4}}, got {value!r}")
        for key, n in value.items():
            if key != "image":
                raise ValueError(f"limit_mm_per_prompt: unsupported modality {key!r} (supported: 'image')")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {n!r}")
        object.__setattr__(self, "limit_mm_per_prompt", tuple(sorted(value.items())))  # hashable, like the config

    def _check_media_fetch(self) -> None:
        import re

        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = domains.replace(",", " ").split()
        if not isinstance(domains, (list, tuple)) or not all(isinstance(d, str) for d in domains):
            raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")
        domains = tuple(dict.fromkeys(d.strip().lower().rstrip(".") for d in domains if d.strip()))
        for d in domains:  # a host name, an IPv4 address or a bare IPv6 address; no scheme, port or path
            if not (re.fullmatch(r"[a-z0-9]([a-z0-9_-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9_-]*[a-z0-9])?)*", d)
                    or (":" in d and re.fullmatch(r"[0-9a-f:.]+", d))):
                raise ValueError(f"allowed_media_domains: {d!r} is not a host name (give names such as "
                                 "upload.wikimedia.org: no scheme, port or path)")
        object.__setattr__(self, "allowed_media_domains", domains)
        if not 0 < self.media_fetch_timeout < float("inf"):
            raise ValueError(f"media_fetch_timeout must be > 0 seconds, got {self.media_fetch_timeout}")
        if isinstance(self.media_fetch_max_bytes, str):  # "20MiB", as the flag takes it
            object.__setattr__(self, "media_fetch_max_bytes", parse_size(self.media_fetch_max_bytes,
                                                                         "media_fetch_max_bytes"))
        if self.media_fetch_max_bytes < 1:
            raise ValueError(f"media_fetch_max_bytes must be >= 1, got {self.media_fetch_max_bytes}")

    def _check_logits_processors(self) -> None:
        procs = self.logits_processors
        if isinstance(procs, (str, type)):
            procs = (procs,)
        object.__setattr__(self, "logits_processors", tuple(procs or ()))
        if not self.logits_processors:
            return
        if self.speculative_config is not None:
            raise ValueError("logits_processors cannot be combined with speculative decoding (speculative_config): "
                             "its verification rows are not one per request")
        if self.runner == "pooling":
            raise ValueError("logits_processors: a pooling model (runner pooling) samples no tokens")
        for p in self.logits_processors:  # loaded (and checked) by the engine at start-up
            if not isinstance(p, (str, type)) or (isinstance(p, str) and not p.strip()):
                raise ValueError(f"logits_processors: expected classes or qualified class names, got {p!r}")

    def _gguf_on_cpu_in_float32(self) -> bool:
        """A GGUF checkpoint on the CPU with dtype "auto" (float32 arithmetic): "auto" gives it a
        bfloat16 KV cache, as llama.cpp keeps an f16 one (half the bytes per token; the attention of
        a 16-row decode step of SmolLM2-135M 1.5x faster; top-1 agreement with HF's float32 load and
        perplexity unchanged: docs/usage.md, GGUF files). dtype="float32" or
        kv_cache_dtype="float32" keeps a float32 cache."""
        if self.dtype != "auto" or self.device not in ("auto", "cpu"):
            return False
        if not _names_gguf(self.model):
            return False
        if self.device == "auto":
            import torch

            return not torch.cuda.is_available()
        return True

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._parse_mm_limits()
        self._check_media_fetch()
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None:
            q = self.quantization.lower().replace("_", "-")
            if q not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} (or None: detected from "
                                 f"config.json), got {self.quantization!r}")
            object.__setattr__(self, "quantization", q)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")  # one canonical name downstream
        if self.kv_cache_dtype == "auto" and self._gguf_on_cpu_in_float32():
            object.__setattr__(self, "kv_cache_dtype", "bfloat16")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if isinstance(self.kv_cache_memory, str):  # "64MiB", as the --kv-cache-memory flag takes it
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory, "kv_cache_memory"))
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if isinstance(self.cpu_kv_cache_idle_prefault, str):
            object.__setattr__(self, "cpu_kv_cache_idle_prefault",
                               parse_size(self.cpu_kv_cache_idle_prefault, "cpu_kv_cache_idle_prefault"))
        if isinstance(self.cpu_kv_cache_idle_prefault, bool) or self.cpu_kv_cache_idle_prefault < 0:
            raise ValueError(f"cpu_kv_cache_idle_prefault must be >= 0 bytes (0: off), got "
                             f"{self.cpu_kv_cache_idle_prefault!r}")
        if not (0.0 < self.cpu_memory_utilization <= 1.0):
            raise ValueError(f"cpu_memory_utilization must be in (0, 1], got {self.cpu_memory_utilization}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_pipeline_parallel()
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' (processes on this machine) or 'ray' (Ray "
                             f"actors across a Ray cluster), got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} with distributed_executor_backend='ray': use 'cuda' (Ray gives "
                             "each worker its own GPU)")
        if self.distributed_executor_backend == "ray" and self.cpu_threads_bind not in (None, "nobind"):
            raise ValueError("cpu_threads_bind is for distributed_executor_backend='mp'; with 'ray' each worker runs "
                             "cpu_threads threads on the CPUs Ray reserves for it")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_num_seqs_per_request is not None and self.max_num_seqs_per_request < 1:
            raise ValueError(f"max_num_seqs_per_request must be >= 1, got {self.max_num_seqs_per_request}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        for name in ("structured_max_bytes", "structured_max_depth", "structured_max_alternatives",
                     "structured_compile_workers", "max_tools", "max_logprob_entries", "max_registered_loras",
                     "max_pooling_inputs", "max_pooling_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_pooling_output_values is not None and self.max_pooling_output_values < 1:
            raise ValueError(f"max_pooling_output_values must be >= 1, got {self.max_pooling_output_values}")
        if self.structured_max_queued_compiles < 0 or self.structured_cache_bytes < 0:
            raise ValueError("structured_max_queued_compiles and structured_cache_bytes must be >= 0")
        if self.structured_compile_isolation not in ("process", "thread"):
            raise ValueError(f"structured_compile_isolation must be 'process' or 'thread', got "
                             f"{self.structured_compile_isolation!r}")
        if self.structured_compile_memory < 0:
            raise ValueError(f"structured_compile_memory must be >= 0 bytes, got {self.structured_compile_memory}")
        if not 0 < self.structured_compile_timeout < float("inf"):
            raise ValueError(f"structured_compile_timeout must be a positive number of seconds, got "
                             f"{self.structured_compile_timeout}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in 1..512, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.max_loras_per_step is not None and not 1 <= self.max_loras_per_step <= self.max_loras:
            raise ValueError(f"max_loras_per_step must be in 1..max_loras ({self.max_loras}), got "
                             f"{self.max_loras_per_step}")
        self._check_kv_offloading()
        self._check_logits_processors()
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.async_scheduling and (self.speculative_config is not None or self.tensor_parallel_size > 1
                                      or self.pipeline_parallel_size > 1 or self.kv_offloading_size is not None):
            raise ValueError("async_scheduling does not support speculative decoding, tensor or pipeline "
                             "parallelism, or the KV offload tier (kv_offloading_size) yet")
        if self.cpu_gemm not in ("auto", "pagedllm", "onednn"):
            raise ValueError(f"cpu_gemm must be 'auto', 'pagedllm' or 'onednn', got {self.cpu_gemm!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_threads_bind is not None:
            cpu_bind_for_rank(self.cpu_threads_bind, 0, self.tensor_parallel_size * self.pipeline_parallel_size)  # raises if malformed
        if _names_gguf(self.model):
            pass  # a GGUF file (or a folder of one): models/gguf.py reads it (and says what is wrong with it)
        elif not os.path.isdir(self.model):
            raise ValueError("model must be a local directory with config.json and safetensors weights, or a .gguf "
                             f"file: {self.model!r}")
        elif not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} has no config.json"
                             + (" (it is empty)" if not os.listdir(self.model) else ""))
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError("generation_config must be 'auto' (the model's generation_config.json), 'vllm' (ignore "
                             f"it) or a directory holding a generation_config.json, got {self.generation_config!r}")


# `pagedllm serve` on CPU runs at most this many sequences at once unless --max-num-seqs says
# otherwise (EngineConfig's 256 stays the offline default). A CPU decode step costs about the
# same per row from ~64 rows up (the GEMMs are compute-bound there and attention, sampling and
# the server's per-token work are per row), so rows beyond ~128 add almost no throughput but
# stretch every stream's time per output token in proportion; requests past the cap wait in the
# queue instead (docs/benchmarks.md, issue 15 serving at saturation). vLLM's CPU server uses 128.
CPU_SERVE_MAX_NUM_SEQS = 128


def _cuda_device_present() -> bool:
    """Whether this host shows an NVIDIA GPU (without importing torch, unless it already is)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.is_available()
    visible = envs.cuda_visible_devices()
    if visible is not None and not visible:
        return False
    return os.path.exists("/dev/nvidia0") or bool(os.path.isdir("/proc/driver/nvidia/gpus")
                                                  and os.listdir("/proc/driver/nvidia/gpus"))


def runs_on_cpu(device: Optional[str]) -> bool:
    """Whether an engine with this ``device`` setting runs on CPU: "cpu", or "auto" on a host without a GPU."""
    device = device or "auto"
    return device == "cpu" or (device == "auto" and not _cuda_device_present())


def serve_default_max_num_seqs(device: Optional[str]) -> int:
    """max_num_seqs of the OpenAI server when the flag is not given: CPU_SERVE_MAX_NUM_SEQS where
    the engine runs on CPU, else EngineConfig's."""
    return CPU_SERVE_MAX_NUM_SEQS if runs_on_cpu(device) else EngineConfig.__dataclass_fields__["max_num_seqs"].default


def resolve_max_waiting_requests(config: EngineConfig) -> int:
    """Sequences allowed to wait beyond the running batch: the flag, or 4 x max_num_seqs."""
    if config.max_waiting_requests is not None:
        return config.max_waiting_requests
    return 4 * config.max_num_seqs


def resolve_max_num_seqs_per_request(config: EngineConfig) -> int:
    """Most sequences of one request running at once: the field (at most max_num_seqs), or
    max_num_seqs (an offline batch job is one client: it may take every slot)."""
    if config.max_num_seqs_per_request is not None:
        return min(config.max_num_seqs_per_request, config.max_num_seqs)
    return config.max_num_seqs


def serve_default_max_num_seqs_per_request(max_num_seqs: int) -> int:
    """The server's share of the running slots one request may hold when the flag is not given:
    a quarter, so a large-n request leaves room for the other clients."""
    return max(1, max_num_seqs // 4)


def hf_field(hf_config, name: str, default=None):
    """A field a checkpoint's config may lack (the light JsonConfig carries its architecture's
    defaults only, a transformers config its own class's fields): its value, else ``default``."""
    return getattr(hf_config, name, default)


def attention_heads(hf_config) -> tuple[int, int, int]:
    """A decoder config's (heads, kv_heads, head_dim): num_key_value_heads defaults to the heads
    (multi-head attention), head_dim to hidden_size / heads."""
    heads = hf_config.num_attention_heads
    kv_heads = hf_field(hf_config, "num_key_value_heads") or heads
    return heads, kv_heads, hf_field(hf_config, "head_dim") or hf_config.hidden_size // heads


def resolve_max_model_len(hf_config, requested: Optional[int]) -> int:
    limit = hf_field(hf_config, "max_position_embeddings") or 2048
    if requested is None:
        return int(limit)
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({limit})")
    return requested


def fit_max_model_len(num_blocks: int, block_size: int, max_model_len: int, user_set: bool,
                      sliding_window: Optional[int] = None, max_chunk_tokens: Optional[int] = None) -> int:
    """The context length the KV cache can serve: ``max_model_len`` if one sequence of that many
    tokens fits in ``num_blocks`` blocks; else, when the user did not set it, what fits (the
    caller logs it); when they did, a ValueError naming the largest value that fits.

    With a ``sliding_window`` every layer shares, blocks behind the window are freed, so a sequence
    of any length holds at most the window plus one step's chunk (``max_chunk_tokens``): a chunk
    [P, P+n) needs blocks from the one holding P-W+1 to the one holding P+n-1."""
    fits = num_blocks * block_size
    if fits >= max_model_len:
        return max_model_len
    if sliding_window is not None and max_chunk_tokens is not None:
        chunk = min(max_chunk_tokens, max_model_len)
        if num_blocks >= -(-(chunk + sliding_window - 1) // block_size) + 1:
            return max_model_len
    more = "give the KV cache more memory (kv_cache_memory, cpu_memory_utilization or gpu_memory_utilization)"
    if fits < 2:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {block_size} tokens: not even one sequence "
                         f"fits; {more}")
    if user_set:
        raise ValueError(f"max_model_len {max_model_len} does not fit in the KV cache ({num_blocks} blocks x "
                         f"{block_size} tokens = {fits} tokens); the largest max_model_len that fits is {fits}: "
                         f"pass max_model_len <= {fits}, or {more}")
    return fits


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    if config.max_num_batched_tokens is not None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled"
            )
        return config.max_num_batched_tokens
    return 2048 if config.enable_chunked_prefill else max(2048, max_model_len)


_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str, name: str = "size") -> int:
    """Bytes from ``"1073741824"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``; ValueError naming ``name``."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name} is not a size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11] (Linux cpulist syntax)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpu_threads_bind: {part!r} is not a CPU id or range (examples: 0-3, 0,2,4)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"cpu_threads_bind: empty range {part!r}")
        cpus.extend(range(a, b + 1))
    return sorted(set(cpus))


def cpu_bind_for_rank(bind: Optional[str], rank: int, world_size: int, available: Optional[list[int]] = None) -> Optional[list[int]]:
    """The CPUs rank ``rank`` is bound to, or None for no binding.

    ``bind`` as vLLM's VLLM_CPU_OMP_THREADS_BIND: ``"nobind"`` (or None): the OS schedules;
    ``"auto"``: the process's allowed CPUs split evenly across the ranks, in order;
    ``"0-3|4-7"``: an explicit CPU list per rank, ranks separated by ``|``.
    """
    if bind is None or bind == "nobind":
        return None
    if bind == "auto":
        cpus = sorted(available if available is not None else _allowed_cpus())
        share = len(cpus) // world_size
        if share < 1:
            raise ValueError(f"cpu_threads_bind=auto: {len(cpus)} CPUs cannot be split across {world_size} ranks")
        return cpus[rank * share:(rank + 1) * share]
    per_rank = bind.split("|")
    if len(per_rank) != world_size:
        raise ValueError(f"cpu_threads_bind {bind!r} names {len(per_rank)} CPU lists (separated by '|'), "
                         f"but there are {world_size} tensor-parallel ranks")
    lists = [parse_cpu_list(p) for p in per_rank]
    return lists[rank]


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
