"""What a multi-model server may serve: one ModelEntry per model, from ``--model`` (given more
than once), ``--models-dir`` and ``--models-config``.

- ``--model A --model B``: each served under its ``--served-model-name`` (one name per model, in
  order) or its stem (the folder's name, a .gguf file's name without the suffix).
- ``--models-dir DIR``: every checkpoint folder (one with a config.json) and every .gguf file
  directly in DIR, named by stem.
- ``--models-config FILE`` (YAML or JSON)::

      models:
        - model: /srv/models/qwen            # a folder or a .gguf file (required)
          name: chat                         # or names: [chat, qwen]; default: the stem
          pin: true                          # never unloaded
          options: {dtype: bfloat16, max_model_len: 4096, kv_cache_memory: 512MiB,
                    lora_modules: ["sql=/srv/lora/sql"]}
        - model: /srv/models/bge
          options: {runner: pooling}

  ``options`` are ``pagedllm serve`` flags by their long name (``max-model-len`` or
  ``max_model_len``); they come after the flags given on the command line, so they win.

Every name a request's ``model`` may use (served names and LoRA adapter names) picks one entry;
a name used twice is an error at start-up.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedllm.entrypoints.cli_serve_flags import JSON_VALUED_FLAGS

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# flags the launcher sets for each model itself (or that make no sense per model)
_NOT_PER_MODEL = frozenset({"host", "port", "model", "model_pos", "api_key", "served_model_name",
                            "data_parallel_size", "models_dir", "models_config", "models_memory",
                            "model_idle_timeout", "pin_model", "model_load_timeout", "help", "version"})
_ENTRY_KEYS = frozenset({"model", "name", "names", "pin", "options"})


@dataclass(frozen=True)
class ModelEntry:
    path: str  # a checkpoint folder or a .gguf file
    names: tuple[str, ...]  # the served names; the first is the one reported
    flags: tuple[str, ...] = ()  # this model's own serve flags (after the command line's)
    pinned: bool = False
    lora_names: tuple[str, ...] = ()  # adapter names its requests may use as ``model``
    options: dict = field(default_factory=dict, compare=False)  # dest -> value, as given

    @property
    def name(self) -> str:
        return self.names[0]

    def weight_bytes(self) -> int:
        """The size of the weight files on disk (the model's weights once loaded, about)."""
        if os.path.isfile(self.path):
            return os.path.getsize(self.path)
        total = 0
        for root, _, files in os.walk(self.path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(WEIGHT_SUFFIXES))
        return total


def model_stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.lower().endswith(".gguf") else base


def _servable(path: str) -> bool:
    if os.path.isfile(path):
        return path.lower().endswith(".gguf")
    return os.path.isfile(os.path.join(path, "config.json"))


def scan_models_dir(directory: str) -> list[str]:
    """The checkpoint folders and .gguf files directly in ``directory``, sorted by name."""
    if not os.path.isdir(directory):
        raise ValueError(f"--models-dir {directory!r} is not a directory")
    found = [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if not n.startswith(".")]
    return [p for p in found if _servable(p)]


def option_flags(options: dict[str, Any], dests: dict[str, Any], where: str) -> tuple[str, ...]:
    """``{"max_model_len": 512, "enforce_eager": true}`` -> ``("--max-model-len", "512", "--enforce-eager")``;
    ``dests``: the serve parser's flag names and defaults. An unknown name is a ValueError naming it."""
    out: list[str] = []
    for key, value in options.items():
        dest = str(key).replace("-", "_")
        if dest in _NOT_PER_MODEL:
            raise ValueError(f"{where}: option {key!r} is set by the multi-model server itself, not per model")
        if dest not in dests:
            raise ValueError(f"{where}: unknown option {key!r} (options are `pagedllm serve` flags, e.g. "
                             "max_model_len, dtype, kv_cache_memory)")
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif dest in JSON_VALUED_FLAGS or isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, list):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif value is not None:
            out += [flag, str(value)]
    return tuple(out)


def lora_adapter_names(values: Sequence[Any]) -> tuple[str, ...]:
    """The adapter names of ``--lora-modules`` values (``name=path`` or a JSON object with a name)."""
    names = []
    for v in values or ():
        if isinstance(v, dict):
            names.append(str(v.get("name", "")))
            continue
        text = str(v).strip()
        if text.startswith("{"):
            try:
                names.append(str(json.loads(text).get("name", "")))
            except (ValueError, AttributeError):
                continue
        elif "=" in text:
            names.append(text.split("=", 1)[0])
    return tuple(n for n in names if n)


def _read_config(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--models-config {path!r}: {e.strerror}") from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError("--models-config: a YAML file needs PyYAML (pip install pyyaml), or give JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--models-config {path!r} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--models-config {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or set(data) != {"models"} or not isinstance(data["models"], list):
        raise ValueError(f"--models-config {path!r}: expected one key, 'models', holding a list of models")
    for i, item in enumerate(data["models"]):
        if not isinstance(item, dict) or "model" not in item:
            raise ValueError(f"--models-config {path!r}: models[{i}] needs a 'model' path")
        unknown = set(item) - _ENTRY_KEYS
        if unknown:
            raise ValueError(f"--models-config {path!r}: models[{i}] has unknown keys {sorted(unknown)} "
                             f"(allowed: {sorted(_ENTRY_KEYS)})")
        if not isinstance(item.get("options", {}), dict):
            raise ValueError(f"--models-config {path!r}: models[{i}].options must be a mapping of serve flags")
    base = os.path.dirname(os.path.abspath(path))
    return [{**item, "model": os.path.join(base, os.path.expanduser(str(item["model"])))} for item in data["models"]]


def _entry(path: str, names: Sequence[str], options: dict, pinned: bool, dests: dict, global_lora: Sequence[Any],
           where: str) -> ModelEntry:
    if not os.path.exists(path):
        raise ValueError(f"{where}: no such model: {path!r}")
    flags = option_flags(options, dests, where)
    lora = lora_adapter_names(list(global_lora or ()) + list(options.get("lora_modules", options.get("lora-modules"))
                                                              or ()))
    return ModelEntry(path=path, names=tuple(names) or (model_stem(path),), flags=flags, pinned=pinned,
                      lora_names=lora, options=dict(options))


def build_catalog(args: argparse.Namespace, dests: dict[str, Any]) -> list[ModelEntry]:
    """The entries of a multi-model ``serve``'s flags (``dests``: the serve parser's defaults by dest)."""
    paths = ([args.model_pos] if args.model_pos else []) + list(args.model or [])
    names = list(args.served_model_name or [])
    if names and len(names) != len(paths):
        raise ValueError(f"with several models, --served-model-name takes one name per --model, in order "
                         f"({len(paths)} models, {len(names)} names)")
    lora = args.lora_modules or ()
    entries = [_entry(p, [names[i]] if names else [], {}, False, dests, lora, "--model")
               for i, p in enumerate(paths)]
    if args.models_dir:
        found = scan_models_dir(args.models_dir)
        if not found and not paths and not args.models_config:
            raise ValueError(f"--models-dir {args.models_dir!r} holds no checkpoint folder (with a config.json) "
                             "and no .gguf file")
        entries += [_entry(p, [], {}, False, dests, lora, "--models-dir") for p in found]
    if args.models_config:
        for i, item in enumerate(_read_config(args.models_config)):
            given = item.get("names") or ([item["name"]] if item.get("name") else [])
            if not isinstance(given, list) or not all(isinstance(n, str) and n for n in given):
                raise ValueError(f"--models-config: models[{i}] names must be non-empty strings")
            entries.append(_entry(item["model"], given, item.get("options") or {}, bool(item.get("pin", False)),
                                  dests, lora, f"--models-config models[{i}]"))
    pins = set(args.pin_model or ())
    entries = [dataclasses.replace(e, pinned=e.pinned or bool(pins & set(e.names))) for e in entries]
    _check_names(entries, pins)
    return entries


def _check_names(entries: list[ModelEntry], pins: set[str]) -> None:
    seen: dict[str, str] = {}
    for e in entries:
        for n in (*e.names, *e.lora_names):
            if n in seen and seen[n] != e.path:
                raise ValueError(f"the model name {n!r} is used twice ({seen[n]} and {e.path}): give each model "
                                 "its own --served-model-name (or name in --models-config)")
            seen[n] = e.path
    unknown = pins - set(seen)
    if unknown:
        raise ValueError(f"--pin-model {sorted(unknown)}: no such model (models: {sorted(e.name for e in entries)})")


def resolve(entries: Sequence[ModelEntry], name: Optional[str]) -> Optional[ModelEntry]:
    """The entry a request's ``model`` names (a served name or one of its LoRA adapters)."""
    for e in entries:
        if name in e.names or name in e.lora_names:
            return e
    return None
