"""Executors: how a step reaches the workers (one in-process worker, ranks in processes, Ray
actors, or executor/simulated.py's simulated device)."""


def executor_class(config):
    """The executor the config asks for (imported only when chosen): Ray's actors, worker
    processes for tensor / pipeline parallel ranks, or the one in-process worker."""
    if config.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    from pagedllm.executor.uniproc import UniprocExecutor

    return UniprocExecutor
