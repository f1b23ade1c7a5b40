import subprocess
import sys


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('core must not import torch')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.contracts\n"
        "import pagedllm.core.block_pool, pagedllm.core.block_hash, pagedllm.core.request\n"
        "assert 'torch' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
