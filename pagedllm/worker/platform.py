"""What differs between devices in a worker, behind one object chosen once (``make_platform``).

- ``configure_threads``: CPU threads and their binding (worker/cpu_threads.py), before the model
  is built; nothing on CUDA;
- ``prepare_model``: after the weights are loaded, CPU packs them for its GEMM kernels (and loads
  the C++ kernels); CUDA has nothing to do;
- ``kv_budget``: the bytes the KV cache may take (CPU: host memory less one step's estimated
  activations; CUDA: what a profiling forward leaves of gpu_memory_utilization);
- ``graph_plugin``: CUDA graphs of decode steps (worker/cuda_graphs.py), None on CPU;
- ``estimates_activations``: the start-up plan says "~" before an estimated figure.
"""
from __future__ import annotations

import logging
from typing import Optional, Protocol

import torch

from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedllm.models.quantized import prepare_quantized_layers
from pagedllm.worker.cpu_memory import keep_freed_activations
from pagedllm.worker.cpu_threads import CpuThreadDecision, configure_cpu_threads

logger = logging.getLogger(__name__)


class Platform(Protocol):
    name: str
    estimates_activations: bool

    def configure_threads(self, config) -> Optional[CpuThreadDecision]: ...

    def prepare_model(self, model, dtype: torch.dtype, config, threads: Optional[CpuThreadDecision]) -> Optional[dict]: ...

    def kv_budget(self, worker) -> int: ...

    def graph_plugin(self, worker): ...


class CpuPlatform:
    name = "cpu"
    estimates_activations = True

    def configure_threads(self, config) -> CpuThreadDecision:
        tp, pp = get_tp_group(), get_pp_group()
        if pp.world_size > 1:  # every rank of every stage shares the host's cores
            return configure_cpu_threads(config, pp.global_rank, pp.global_world)
        return configure_cpu_threads(config, tp.rank, tp.world_size)

    def prepare_model(self, model, dtype: torch.dtype, config, threads: Optional[CpuThreadDecision]) -> dict:
        """Kernels loaded, weights packed for their GEMM; returns the CPU's description."""
        from pagedllm.kernels import cpu as cpu_kernels
        from pagedllm.layers.cpu_gemm import gemm_forms, pack_linear_weights
        from pagedllm.layers.moe import GroupedExperts

        # Built once per machine and cached on disk (`make` prebuilds them); the weights are
        # packed for their GEMM, and every layer takes what they support (for_tensor).
        if config.cpu_kernels:
            cpu_kernels.load(config.kernel_cache_dir)
        pack_linear_weights(model, dtype, config.cpu_gemm, config.kernel_cache_dir)
        prepare_quantized_layers(model)  # quantized weights in the quantized GEMM kernels' layout
        for module in [m for m in model.modules() if isinstance(m, GroupedExperts)]:
            module.pack_for_cpu(dtype)  # MoE experts: each expert's projections
        keep_freed_activations(config.cpu_keep_freed_memory)  # after loading: the load's temporaries went back to the OS
        d = dict(cpu_kernels.describe(), gemm_mode=config.cpu_gemm, gemm_forms=gemm_forms(model),
                 threads=threads.as_dict() if threads is not None else None)
        forms = ", ".join(f"{k} {v}" for k, v in d["gemm_forms"].items() if v)
        logger.info("CPU %s (%s), %d threads, %s: kernels %s (level %s, best for this CPU %s); linear layers "
                    "(cpu_gemm=%s): %s", d["cpu_model"], " ".join(d["cpu_flags"]), torch.get_num_threads(),
                    dtype, d["kernels"], d["isa"], d["isa_cpu_best"], config.cpu_gemm, forms or "none")
        return d

    def kv_budget(self, worker) -> int:
        return worker.kv_budget_on_cpu()  # worker.py keeps it (its tests patch that module's names)

    def graph_plugin(self, worker):
        return None


class CudaPlatform:
    name = "cuda"
    estimates_activations = False

    def configure_threads(self, config) -> None:
        return None

    def prepare_model(self, model, dtype: torch.dtype, config, threads) -> None:
        return None

    def kv_budget(self, worker) -> int:
        return worker.kv_budget_on_cuda()

    def graph_plugin(self, worker):
        """CUDA graphs of decode steps, unless enforce_eager (or a feature they do not cover yet)."""
        config = worker.config
        if config.enforce_eager:
            return None
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            logger.info("CUDA graphs are not used with tensor or pipeline parallelism yet: running eagerly")
            return None
        if worker.lora is not None:
            logger.info("CUDA graphs are not used with LoRA adapters yet: running eagerly")
            return None
        from pagedllm.worker.cuda_graphs import DecodeGraphRunner

        graphs = DecodeGraphRunner(worker.model, min(config.max_num_seqs, 512),
                                   -(-worker.max_model_len // worker.kv_spec.block_size), worker.max_model_len,
                                   worker.device)
        graphs.capture()
        return graphs


def make_platform(device: torch.device) -> Platform:
    return CpuPlatform() if device.type == "cpu" else CudaPlatform()
