"""Where an engine step's time goes: schedule, execute (prepare inputs + forward + sample), update,
and the front end's output processing, per step (the same StepTiming the server exports as
``engine_step_phase_seconds``), over the fixed-seed random workload; and the run's throughput.

With ``--engine-core-process`` the core runs in its own process (the server's arrangement): the
front end's output processing then overlaps the core's next step instead of adding to it.
``--sim-device D``: the simulated device (executor/simulated.py) with at least D seconds a step,
running the fake token model (``--sim-model fake``: the step is then D plus the host's own
cost), the real model on its thread, or (``--sim-model runner``) the real runner's host work --
diffs, input preparation, state update, output assembly -- on the host thread with only the
forward and sampling simulated, e.g. at an H200's decode floors of a 1.1B Llama:

    python benchmarks/step_phases.py --sim-device 0.00069 --sim-model runner --async-scheduling \
        --prompt-len 8 --output-len 128 --num-requests 256

    python benchmarks/step_phases.py --model llama-tiny --num-requests 64
    python benchmarks/step_phases.py --model llama-tiny --num-requests 64 --engine-core-process

``--async-scheduling``: the core schedules step N+1 while step N runs (engine/core.py); with
``--sim-device 0.002 --prompt-len 8 --num-requests 64`` the "ms per step" line is the issue-31
target (within 1.15x of the device's 2 ms).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, random_workload, write_json  # noqa: E402

PHASES = ("schedule", "execute", "update", "output", "total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=0, help="fixed prompt length (0: the random workload's)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens per request with --prompt-len")
    ap.add_argument("--engine-core-process", action="store_true")
    ap.add_argument("--sim-device", type=float, default=None, help="seconds a step at least on a simulated device")
    ap.add_argument("--sim-model", default="fake", choices=["fake", "real", "runner"],
                    help="on the simulated device: the fake token model (host cost only), the real model, or "
                         "the real runner's host work with the forward and sampling simulated (what a GPU's host pays)")
    ap.add_argument("--async-scheduling", action="store_true", help="schedule step N+1 while step N runs")
    ap.add_argument("--out", default="benchmarks/results/step_phases.json")
    args = ap.parse_args()

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    factory = None
    if args.sim_device is not None:
        from pagedllm.executor.simulated import SimulatedDevice

        factory = SimulatedDevice(args.sim_device, num_blocks=1 << 15, real=args.sim_model == "real",
                                  runner=args.sim_model == "runner")
    config = EngineConfig(model=ensure_model(args.model), dtype=args.dtype, kv_cache_memory=4 << 30,
                          generation_config="vllm", async_scheduling=args.async_scheduling)
    engine = LLMEngine(config, skip_tokenizer_init=True, multiprocess=args.engine_core_process,
                       executor_factory=factory)
    if args.prompt_len:
        work = [([3 + (7 * i + j) % 1000 for j in range(args.prompt_len)], args.output_len)
                for i in range(args.num_requests)]
    else:
        work = random_workload(args.num_requests, args.seed)
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    t0 = time.perf_counter()
    for ids, olen in work:
        engine.add_request(None, {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True))
    generated = token_steps = 0
    step_walls = []  # each engine.step() call, front end included
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = engine.step()
        step_walls.append(time.perf_counter() - t_step)
        token_steps += bool(engine.last_core_outputs.outputs)  # brought tokens (async scheduling: not the first step)
        for out in outs:
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        timing = engine.last_core_outputs.timing
        if timing is not None:
            for p in ("schedule", "execute", "update", "total"):
                samples[p].append(getattr(timing, p))
            samples["output"].append(engine.last_output_seconds)
    wall = time.perf_counter() - t0
    # a simulated device's own time per step (its sleeps wake late on a busy host): the target's yardstick
    device_ms = 1000 * engine.core.executor.device_busy / max(token_steps, 1) if factory and engine.client.in_process else None
    engine.shutdown()

    def ms(xs, q):
        if not xs:
            return ""
        xs = sorted(xs)
        return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)

    # the steady decode steps: without the first (admitting every request) and the last (retiring them)
    steady = step_walls[1:-1] if len(step_walls) > 2 else step_walls
    steady_ms = 1000 * statistics.fmean(steady) if steady else 0.0
    rows = [{"phase": p, "mean_ms": round(1000 * statistics.fmean(samples[p]), 3) if samples[p] else "",
             "p50_ms": ms(samples[p], 0.5), "p99_ms": ms(samples[p], 0.99)} for p in PHASES]
    print(f"{args.model} {args.dtype}, {args.num_requests} requests, core "
          f"{'in its own process' if args.engine_core_process else 'in-process'}"
          f"{f', simulated device {args.sim_device * 1000:g} ms ({args.sim_model})' if args.sim_device is not None else ''}"
          f"{', async scheduling' if args.async_scheduling else ''}: "
          f"{len(samples['total'])} steps, {generated} tokens in {wall:.2f} s = {generated / wall:,.1f} tok/s; "
          f"{1000 * wall / max(token_steps, 1):.3f} ms per step (wall / {token_steps} steps with tokens, "
          f"adding and admitting the requests included); steady decode steps {steady_ms:.3f} ms (mean of all but "
          f"the first and the last step)"
          + (f"; the device busy {device_ms:.3f} ms per step" if device_ms is not None else ""))
    print_table(rows, ["phase", "mean_ms", "p50_ms", "p99_ms"])
    write_json(args.out, {"args": vars(args), "steps": len(samples["total"]), "generated": generated,
                          "wall_s": wall, "ms_per_step": 1000 * wall / max(token_steps, 1),
                          "steady_ms_per_step": steady_ms, "device_ms_per_step": device_ms, "tok_per_s": generated / wall, "phases": rows,
                          "loadavg": open("/proc/loadavg").read().split()[:3]})


if __name__ == "__main__":
    main()
