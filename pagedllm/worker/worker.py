"""Worker: picks the device, loads the model, sizes and allocates the paged KV cache."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.attention.kv_quant import KVQuant, SCALE_DTYPE, kv_quant, kv_storage_dtype
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import EngineConfig, fit_max_model_len, hf_field
from pagedllm.heap import collect_and_trim
from pagedllm.models import decode_stack
from pagedllm.models.loader import load_weights
from pagedllm.layers.linear import linear_weights_on_meta
from pagedllm.models.gguf import find_gguf_file, gguf_quantization, gguf_weights
from pagedllm.models.quantized import finish_quantized_layers, pack_gguf_vocab_tables, quantize_linear_layers
from pagedllm.quantization.registry import resolve_quantization
from pagedllm.models.registry import resolve_model_class
from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.models.pipeline import check_pipeline_support
from pagedllm.worker.cpu_memory import IdlePrefault, cpu_kv_cache_memory
from pagedllm.worker.cpu_threads import CpuThreadDecision, thread_governor
from pagedllm.worker.memory_plan import cpu_kv_budget, estimate_activation_bytes, gib, read_host_memory
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.platform import make_platform
from pagedllm.worker.runner_plugins import NoSpec, RunnerPlugins

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        dtype = _DTYPES[name]
    else:
        cfg = hf_field(hf_config, "torch_dtype") or hf_field(hf_config, "dtype")
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg, torch.float32)
        dtype = cfg if cfg in _DTYPES.values() else torch.float32
    if device.type == "cpu" and name == "auto" and dtype != torch.float32 and not cpu_has_native_bf16():
        # Without AVX512-BF16/AMX, bf16/fp16 matmuls are emulated and several times slower than
        # float32 (measured: 4.5 vs 23 GFLOP/s on an AVX2-only EPYC); "auto" picks the fast one.
        logger.info("CPU lacks native bf16 support: computing in float32 (pass dtype=... to override)")
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        logger.warning("float16 is slow and imprecise on CPU; using bfloat16 instead")
        dtype = torch.bfloat16
    return dtype


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 products in hardware (the kernels' ISA detection decides)."""
    from pagedllm.kernels import isa

    return bool({"avx512_bf16", "amx_bf16"} & isa.cpu_flags())


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer ``planes`` x [num_blocks, block_size, num_kv_heads, head_dim]: 2 planes (K and V)
    for multi-head attention; 1 plane of one vector per token for multi-head latent attention
    (DeepSeek's compressed latent and rope key: num_kv_heads 1, head_dim kv_lora_rank +
    qk_rope_head_dim). ``quant`` (kv_cache_dtype fp8/int8): the planes hold 8-bit values and a
    bfloat16 scale per (token, kv head) beside them, [planes, layers, num_blocks, block_size,
    num_kv_heads], counted in the bytes per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    planes: int = 2
    quant: Optional[KVQuant] = None

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.quant.dtype if self.quant is not None else self.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quant is not None else 0
        return self.planes * self.num_layers * self.num_kv_heads * (self.head_dim * elem + scale)

    def allocate(self, num_blocks: int, device: torch.device,
                 prefault: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(cache [planes, layers, num_blocks, block_size, kv_heads, head_dim], scales or None);
        on CPU one zero-filled mapping holds both (its pages faulted in now with ``prefault``)."""
        shape = (self.planes, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        numel = self.planes * self.num_layers * num_blocks * self.block_size * self.num_kv_heads
        if device.type != "cpu":
            cache = torch.zeros(shape, dtype=self.storage_dtype, device=device)
            scales = None if self.quant is None else torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            return cache, scales
        buf = cpu_kv_cache_memory(num_blocks * self.bytes_per_block, prefault)
        cache_bytes = numel * self.head_dim * torch.empty((), dtype=self.storage_dtype).element_size()
        cache = buf[:cache_bytes].view(self.storage_dtype).view(shape)
        scales = None if self.quant is None else buf[cache_bytes:].view(SCALE_DTYPE).view(shape[:-1])
        return cache, scales

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def idle_prefault(self, cache: torch.Tensor, scales: Optional[torch.Tensor], num_blocks: int,
                      upto: int) -> IdlePrefault:
        """What faults ``allocate``'s CPU mapping in while the engine idles: blocks 0..upto-1 of
        each [planes x layers] run of ``num_blocks`` blocks of the cache (and of the scales),
        lowest blocks first."""
        per_token = self.num_kv_heads * self.head_dim * cache.element_size()
        regions = [(cache.data_ptr(), self.block_size * per_token, self.planes * self.num_layers)]
        if scales is not None:
            regions.append((scales.data_ptr(), self.block_size * self.num_kv_heads * scales.element_size(),
                            self.planes * self.num_layers))
        return IdlePrefault(regions, num_blocks, upto)


class Worker:
    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cpu_description: dict | None = None  # CPU model, flags and kernel level (CPU only)
        self.cpu_threads: CpuThreadDecision | None = None  # threads, binding, quota and why (CPU only)
        self.platform = make_platform(self.device)  # the device's differences, chosen once (worker/platform.py)
        torch.manual_seed(config.seed)
        self.cpu_threads = self.platform.configure_threads(config)
        self.thread_governor = thread_governor(config, self.cpu_threads) if self.cpu_threads else None
        model_cls = resolve_model_class(hf_config)
        check_pipeline_support(model_cls)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            gguf_file = find_gguf_file(config.model)  # a GGUF file: its blocks stay packed (quantization/gguf.py)
            quant = (gguf_quantization(gguf_file, hf_config, config.quantization) if gguf_file
                     else resolve_quantization(config.model, config.quantization))
            with torch.device(self.device), linear_weights_on_meta(quant is not None):
                self.model = model_cls(hf_config)
            with torch.device(self.device):
                quantize_linear_layers(self.model, quant)  # quantized layers never get a dense weight
                if gguf_file:
                    pack_gguf_vocab_tables(self.model, quant)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, config.model, gguf_weights(gguf_file, hf_config) if gguf_file else None)
        finish_quantized_layers(self.model)
        self.model.eval()
        self.cpu_description = self.platform.prepare_model(self.model, self.dtype, config, self.cpu_threads)
        decode_stack.configure(self.model, config.native_decode)
        collect_and_trim()  # the loader's temporaries (file copies, repacking) handed back: RSS is the weights
        self.lora = None  # LoRA: the model's projections wrapped with adapter slots (after packing)
        if config.enable_lora:
            from pagedllm.lora.slots import LoRASlotManager

            self.lora = LoRASlotManager(self.model, hf_config, config.max_loras, config.max_lora_rank,
                                        config.max_cpu_loras or config.max_loras, self.dtype, self.device)
        layers = self.model.attention_layers()
        a0 = layers[0]
        self.kv_spec = KVCacheSpec(len(layers), a0.num_kv_heads, a0.head_dim, config.block_size,
                                   kv_storage_dtype(config.kv_cache_dtype, self.dtype), a0.kv_planes,
                                   kv_quant(config.kv_cache_dtype))
        windows = {layer.sliding_window for layer in layers}
        # Every layer windowed alike: the scheduler frees blocks that fall out of the window.
        self.kv_sliding_window = windows.pop() if len(windows) == 1 else None
        self.backend = get_attention_backend(self.device)
        self._check_kv_cache_dtype()
        self.num_blocks = 0
        self.activation_bytes = 0  # measured (CUDA) or estimated (CPU) peak of one step
        self.budget_note = ""  # where the KV cache budget came from, for the start-up plan
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # kv_cache_dtype fp8/int8: a scale per (token, kv head)
        self.runner: ModelRunner | None = None
        self.kv_tier = None  # the KV offload tier's copies (worker/kv_tier/), with kv_offloading_size
        self.kv_tier_spec = None  # its KVTierSpec for the core (None: no tier)
        self.drafter = self._make_drafter()  # speculative decoding's draft model, if any (spec_decode/)

    def _check_kv_cache_dtype(self) -> None:
        name = self.config.kv_cache_dtype
        if self.kv_spec.storage_dtype == self.dtype:  # the model's own dtype: every backend runs it
            return
        if name == "float32":
            raise ValueError(f"kv_cache_dtype='float32' keeps a float32 model's cache in float32; this model computes "
                             f"in {str(self.dtype).removeprefix('torch.')} (use dtype='float32', or kv_cache_dtype='auto')")
        if self.kv_spec.planes != 2:
            raise ValueError(f"kv_cache_dtype={name!r}: multi-head latent attention (DeepSeek's one-plane latent cache) "
                             "keeps its cache in the model dtype; use kv_cache_dtype='auto'")
        supported = self.backend.kv_cache_dtypes
        if name not in supported:
            raise ValueError(f"kv_cache_dtype={name!r} is not supported by the {self.backend.name} attention backend "
                             f"({self.device.type}); it supports {supported}")

    def _make_drafter(self):
        spec = self.config.speculative_config
        if spec is None or spec.method not in ("draft_model", "eagle"):
            return None
        if get_tp_group().world_size > 1:
            raise ValueError(f"speculative_config method {spec.method!r} does not support tensor parallelism yet "
                             "(use 'ngram', or tensor_parallel_size=1)")
        if self.kv_sliding_window is not None or any(a.sliding_window for a in self.model.attention_layers()):
            raise ValueError(f"speculative_config method {spec.method!r} does not support sliding-window targets yet")
        if spec.method == "eagle":
            if self.kv_spec.planes != 2:
                raise ValueError("speculative_config method 'eagle' does not support multi-head latent attention "
                                 "targets (an EAGLE-1 head is defined over Llama-family targets)")
            from pagedllm.spec_decode.eagle import EagleProposer

            return EagleProposer(spec.model, spec.num_speculative_tokens, self.model, self.hf_config, self.dtype,
                                 self.device, self.config.block_size)
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(spec.model, spec.num_speculative_tokens, self.hf_config.vocab_size, self.dtype,
                                  self.device, self.config.block_size)

    def determine_num_blocks(self) -> int:
        spec = self.kv_spec
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        budget = self.platform.kv_budget(self)
        draft_bytes = self.drafter.bytes_per_block if self.drafter is not None else 0  # its cache: same blocks
        num_blocks = int(budget // (spec.bytes_per_block + draft_bytes))
        # Never allocate more than every sequence at full length could use.
        useful = self.config.max_num_seqs * -(-self.max_model_len // spec.block_size)
        if num_blocks > useful:
            self.budget_note += f"; capped at max_num_seqs x max_model_len ({useful} blocks)"
        return min(num_blocks, useful)

    def kv_budget_on_cpu(self) -> int:
        """kv_cache_memory if set; else this rank's share of cpu_memory_utilization x the host
        memory still available (cgroup limits respected), less one step's activations."""
        tp = get_tp_group()
        self.activation_bytes = estimate_activation_bytes(
            self.hf_config, self.max_num_batched_tokens, self.config.max_num_seqs,
            torch.empty((), dtype=self.dtype).element_size(), tp.world_size, self.max_model_len,
            torch_attention=(self.cpu_description or {}).get("kernels") != "loaded")
        if self.config.kv_cache_memory is not None:
            self.budget_note = f"kv_cache_memory {gib(self.config.kv_cache_memory)} (set explicitly)"
            return self.config.kv_cache_memory
        host = read_host_memory()
        ranks = envs.local_world_size() or tp.world_size * get_pp_group().world_size
        budget = cpu_kv_budget(host, self.config.cpu_memory_utilization, ranks, self.activation_bytes)
        self.budget_note = (f"{gib(host.available)} available ({host.describe()}) x cpu_memory_utilization "
                            f"{self.config.cpu_memory_utilization:g}" + (f" / {ranks} ranks on this host" if ranks > 1
                                                                         else "")
                            + " - activations = " + gib(budget))
        return budget

    def kv_budget_on_cuda(self) -> int:
        """What a profiling forward at the largest batch leaves of gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        # Peak activation memory of one forward at the largest batch the scheduler can send.
        from pagedllm.worker.profile import profile_peak_forward

        peak = profile_peak_forward(self, self.max_num_batched_tokens)
        used_now = total - free
        self.activation_bytes = int(peak)
        if self.config.kv_cache_memory is not None:  # an explicit budget replaces gpu_memory_utilization
            room = free - peak
            if self.config.kv_cache_memory > room:
                raise ValueError(f"kv_cache_memory {gib(self.config.kv_cache_memory)} does not fit on {self.device}: "
                                 f"{gib(free)} free - {gib(peak)} of activations = {gib(room)}")
            self.budget_note = f"kv_cache_memory {gib(self.config.kv_cache_memory)} (set explicitly)"
            return self.config.kv_cache_memory
        budget = int(max(total * self.config.gpu_memory_utilization - used_now - peak, 0))
        self.budget_note = (f"{gib(total)} x gpu_memory_utilization {self.config.gpu_memory_utilization:g} - "
                            f"{gib(used_now)} in use - activations = {gib(budget)}")
        return budget

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` (the same on every rank); lower max_model_len to what they hold
        when the user did not set it (every rank computes the same value)."""
        leader = get_tp_group().rank == 0
        self.max_model_len = self._fit_max_model_len(num_blocks, leader)
        self.num_blocks = num_blocks
        self._allocate_kv_cache(num_blocks)
        self.kv_tier = self._make_kv_tier()
        spec = self.kv_spec
        self.runner = ModelRunner(self.model, spec.block_size, self.hf_config.vocab_size, self.device, self.config.seed,
                                  RunnerPlugins(lora=self.lora, spec=self._spec_plugin(num_blocks),
                                                graphs=self.platform.graph_plugin(self), kv_tier=self.kv_tier,
                                                logits=self._logits_plugin()))
        if leader:
            self._log_memory_plan(num_blocks)

    def _fit_max_model_len(self, num_blocks: int, leader: bool) -> int:
        """The max_model_len ``num_blocks`` hold (lowered only where the user did not set it)."""
        spec = self.kv_spec
        try:
            fitted = fit_max_model_len(num_blocks, spec.block_size, self.max_model_len,
                                       user_set=self.config.max_model_len is not None,
                                       sliding_window=self.kv_sliding_window,
                                       max_chunk_tokens=self.max_num_batched_tokens)
        except ValueError as e:
            raise ValueError(f"{e} (KV cache budget: {self.budget_note or '?'})") from None
        if fitted != self.max_model_len and leader:
            logger.warning("max_model_len lowered from %d (the model's max_position_embeddings) to %d, what the KV "
                           "cache holds (%d blocks x %d tokens); give it more memory for longer contexts",
                           self.max_model_len, fitted, num_blocks, spec.block_size)
        return fitted

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """The cache tensors (and their scales), the CPU idle prefault's plan, each attention
        layer bound to its slice."""
        spec = self.kv_spec
        self.kv_cache, self.kv_scales = spec.allocate(num_blocks, self.device, self.config.cpu_kv_cache_prefault)
        self.kv_idle_prefault = None
        idle_bytes = self.config.cpu_kv_cache_idle_prefault
        if self.device.type == "cpu" and not self.config.cpu_kv_cache_prefault and idle_bytes:
            blocks = min(num_blocks, max(1, idle_bytes // spec.bytes_per_block))
            self.kv_idle_prefault = spec.idle_prefault(self.kv_cache, self.kv_scales, num_blocks, blocks)
        for i, layer in enumerate(self.model.attention_layers()):
            if self.kv_scales is None:
                layer.bind(self.backend, self.kv_cache[:, i])
            else:
                layer.bind(self.backend, self.kv_cache[:, i], self.kv_scales[:, i])

    def _log_memory_plan(self, num_blocks: int) -> None:
        """What the weights, activations and KV cache take (the leader rank logs it)."""
        spec = self.kv_spec
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tokens = num_blocks * spec.block_size
        pp = get_pp_group()
        where = "per rank"
        if pp.world_size > 1:  # this stage's weights and cache: its own layers only (a supports_pp family's
            start, end = self.model.model.start, self.model.model.end  # decoder stack, models/pipeline.py)
            where += f", pipeline stage {pp.rank} of {pp.world_size}: layers {start}..{end - 1}"
        logger.info("memory plan (%s): weights %s; activations %s%s (%d tokens per step); KV cache %s = %d "
                    "blocks x %d tokens = %d tokens (%s per token); max concurrency at max_model_len %d: %.1f",
                    where, gib(weights), "~" if self.platform.estimates_activations else "", gib(self.activation_bytes),
                    self.max_num_batched_tokens, gib(num_blocks * spec.bytes_per_block), num_blocks,
                    spec.block_size, tokens, gib(spec.bytes_per_block // spec.block_size), self.max_model_len,
                    tokens / self.max_model_len)
        logger.info("KV cache budget: %s", self.budget_note)
        if spec.quant is not None:
            auto = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, self.dtype,
                               spec.planes)
            logger.info("KV cache dtype %s (a bfloat16 scale per token and kv head): %d bytes per token where %s "
                        "takes %d: %.2fx the tokens in the same memory", spec.quant.name, spec.bytes_per_token,
                        str(self.dtype).removeprefix("torch."), auto.bytes_per_token,
                        auto.bytes_per_token / spec.bytes_per_token)
        mha = getattr(self.model, "mha_kv_elements_per_token", None)
        if mha is not None:  # latent attention: say what the cache saves
            equivalent = mha() * torch.empty((), dtype=spec.dtype).element_size()
            logger.info("KV cache per token: %d bytes of compressed latent + rope key (the same attention as "
                        "MHA would cache %d bytes: %.1fx more)", spec.bytes_per_token, equivalent,
                        equivalent / spec.bytes_per_token)

    def _make_kv_tier(self):
        """The KV offload tier's store and copies (worker/kv_tier/), sized from kv_offloading_size
        (GiB over all tensor-parallel ranks); ``kv_tier_spec`` tells the core its slots."""
        size = self.config.kv_offloading_size
        if size is None:
            return None
        from pagedllm.core.contracts import KVTierSpec
        from pagedllm.worker.kv_tier.factory import make_tier_store
        from pagedllm.worker.kv_tier.store import TierBlockLayout
        from pagedllm.worker.kv_tier.transfer import TierTransfers

        tp = get_tp_group()
        caches = [self.kv_cache] if self.kv_scales is None else [self.kv_cache, self.kv_scales]
        layout = TierBlockLayout.of(caches)
        per_rank = int(size * (1 << 30)) // tp.world_size
        num_slots = per_rank // layout.bytes_per_block
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size {size:g} GiB holds no KV block (one block is "
                             f"{layout.bytes_per_block * tp.world_size} bytes over {tp.world_size} rank(s))")
        if self.config.kv_offloading_backend == "native":
            host = read_host_memory()
            if num_slots * layout.bytes_per_block > host.available:
                raise ValueError(f"kv_offloading_size {size:g} GiB does not fit in host memory: this rank's share "
                                 f"{gib(num_slots * layout.bytes_per_block)} > {gib(host.available)} available "
                                 f"({host.describe()})")
        store = make_tier_store(self.config, layout, num_slots, tp.rank, self.device)
        self.kv_tier_spec = KVTierSpec(num_slots, layout.bytes_per_block * tp.world_size,
                                       self.config.kv_offloading_backend)
        if tp.rank == 0:
            logger.info("KV offload tier (%s): %d blocks = %s per rank (%d tokens)", self.config.kv_offloading_backend,
                        num_slots, gib(num_slots * layout.bytes_per_block), num_slots * self.kv_spec.block_size)
        return TierTransfers(store, caches, tp)
    def _logits_plugin(self):
        """--logits-processors: a factory of the sampling rank's processors (None without any)."""
        if not self.config.logits_processors:
            return None
        from pagedllm.sample.logits_processors import BatchProcessors, load_processor_classes

        classes = load_processor_classes(self.config.logits_processors)
        return lambda: BatchProcessors(classes, self.config, self.device)

    def _spec_plugin(self, num_blocks: int):
        """Speculative decoding (spec_decode/): proposers and verification, drawing from the
        sampling rank's generator (the runner makes it); NoSpec without it."""
        if self.config.speculative_config is None:
            return NoSpec
        from pagedllm.spec_decode.decoder import SpecDecoder

        if self.drafter is not None:
            self.drafter.allocate(num_blocks, self.backend)
        return lambda generator: SpecDecoder(self.config.speculative_config, generator, self.drafter)

    def idle_work(self, seconds: float) -> bool:
        """What the worker does while the engine has nothing to run, for about ``seconds``
        (the CPU KV cache's idle prefault); whether any is left."""
        return self.kv_idle_prefault is not None and self.kv_idle_prefault.run(seconds)

    def execute(self, scheduler_output):
        """One step (pipeline parallelism: this stage's part of it; the last stage's sampling
        rank returns the step's output, the other ranks' outputs carry no tokens)."""
        if self.thread_governor is not None:
            self.thread_governor.tick()
        return self.runner.execute(scheduler_output)

    def execute_host(self, scheduler_output):
        """A step's host work alone (the runner's ``execute_host``: a simulated device runs the rest)."""
        return self.runner.execute_host(scheduler_output)
