"""A grammar compile worker (structured_output/compile_process.py's loop, pipes and heap cap) whose
compiles misbehave on request, for tests. It starts without xgrammar (and so without torch: a
start costs an interpreter, not 270 MiB and seconds), so it compiles nothing real: a grammar
whose text is ``SLEEP`` never finishes, ``ALLOC`` allocates until the worker's heap cap stops it,
``FAST`` answers at once (an empty serialized grammar)."""
import sys
import time

from pagedllm.structured_output.compile_process import worker_main


class _Answer:
    def serialize_json(self) -> str:
        return "{}"


def misbehaving(compiler, key):
    if key == ("grammar", "SLEEP"):
        time.sleep(3600)
    if key == ("grammar", "ALLOC"):
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    if key == ("grammar", "FAST"):
        return _Answer()
    raise ValueError(f"structured_outputs.{key[0]}: this test worker compiles nothing real")


if __name__ == "__main__":
    worker_main(sys.argv[1:], misbehaving, compiler_factory=lambda info_json: None)
