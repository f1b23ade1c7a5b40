"""``pagedllm bench``: throughput (offline), latency (offline), serve (any OpenAI-compatible
server) and compare (result files side by side), with optional PNG charts (``pagedllm[bench]``).

Every run writes a JSON result holding the exact command, the machine (CPU flags, GPU name,
load average) and the measured figures; imports stay lazy (torch only for the offline kinds).
"""
