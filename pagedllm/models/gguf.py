"""GGUF files (llama.cpp's single-file format) as pagedllm models: the config, tokenizer and chat
template from the file's metadata, the weights read from it as they are.

``LLM(model="x.gguf")`` / ``pagedllm serve --model x.gguf`` (or a folder holding one .gguf file):

- **Metadata.** The first load of a file converts its metadata once, with transformers' GGUF
  readers (the architecture's hyperparameters, the tokenizer's vocabulary, merges and special
  tokens, the chat template), into a small folder in pagedllm's cache
  (``$PAGEDLLM_CACHE_DIR/gguf/<stem>-<key>/``: config.json, tokenizer.json, tokenizer_config.json,
  generation_config.json; ``key`` hashes the file's path, size and modification time and the
  converter's version). Every later load reads that folder like any checkpoint folder, in
  milliseconds.
- **Weights.** :func:`gguf_weights` yields each tensor under its HF name as a
  :class:`GGUFTensorSource` over the file's memory map: quantized tensors stay in their blocks
  (``quantization/gguf.py`` multiplies them packed); float tensors (norms, biases) are read as
  floats. llama.cpp's converter permutes the rows of Llama's q/k projections for its rotary
  layout; the permutation is undone on the packed rows (whole rows move, blocks are untouched).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from pagedllm import envs

# general.architecture -> our model class. Only families whose GGUF layout is tested here against
# HF's load of the same file (tests/models/test_gguf.py); others are refused with this list.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",  # llama.cpp writes Mistral models as "llama" (general.name says which)
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# q/k rows permuted by llama.cpp's converter (its rotary pairs adjacent dims; HF's halves)
_PERMUTED_QK = ("llama", "mistral")
_CONVERTER_VERSION = "3"
TENSOR_MAP = "gguf_tensor_map.json"  # in the metadata folder: GGUF tensor name -> HF name


def find_gguf_file(path: str) -> Optional[str]:
    """The GGUF file ``path`` names: the file itself, or the one .gguf file in a folder without a
    config.json; None when ``path`` is not a GGUF model. A folder with several .gguf files is an
    error naming them (which one is meant is not guessed)."""
    if os.path.isfile(path):
        return path if _is_gguf_file(path) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"model folder {path!r} holds several GGUF files ({', '.join(found)}); pass the one to "
                         "serve as --model")
    return os.path.join(path, found[0]) if found else None


def _is_gguf_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def served_name(path: str) -> str:
    """The default served model name of a GGUF model: the file's stem."""
    file = find_gguf_file(path) or path
    return os.path.splitext(os.path.basename(file))[0]


def default_served_name(model: str) -> str:
    """The name clients use for ``model`` when none is given: a GGUF model's file stem, else the path."""
    try:
        file = find_gguf_file(model)
    except ValueError:
        file = None
    return served_name(file) if file else model


def _reader(file: str):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # a dependency, but say what is missing if it was removed
        raise ValueError("loading GGUF files needs the 'gguf' package (pip install gguf)") from e
    try:
        return GGUFReader(file)
    except Exception as e:
        raise ValueError(f"cannot read the GGUF file {file!r} (corrupt or truncated?): {type(e).__name__}: {e}") from None


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def architecture(reader, file: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {file!r}: architecture {arch!r} is not supported; supported GGUF architectures: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    name = str(_field(reader, "general.name") or "").lower()
    return "mistral" if arch == "llama" and "mistral" in name else arch


def metadata_dir(path: str) -> str:
    """``path`` itself for a checkpoint folder; for a GGUF model, the cached folder holding its
    metadata as config.json + tokenizer files (converted on first use)."""
    file = find_gguf_file(path)
    if file is None:
        return path
    real = os.path.realpath(file)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{_CONVERTER_VERSION}".encode()).hexdigest()[:16]
    root = os.path.join(envs.cache_dir(), "gguf")
    out = os.path.join(root, f"{served_name(real)}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
    try:
        _convert_metadata(real, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process converted it first
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_metadata(file: str, out: str) -> None:
    reader = _reader(file)
    arch = architecture(reader, file)
    gguf_arch = _field(reader, "general.architecture")
    head_dim = _field(reader, f"{gguf_arch}.attention.key_length")  # transformers skips it for some families
    del reader
    folder, name = os.path.split(file)
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:
        raise ValueError(f"GGUF file {file!r}: its metadata does not map to a model config: {e}") from None
    config = hf.to_dict()
    if head_dim:
        config["head_dim"] = int(head_dim)
    config["architectures"] = [GGUF_ARCHITECTURES[arch]]
    config["gguf_architecture"] = arch
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:
        raise ValueError(f"GGUF file {file!r}: its tokenizer metadata cannot be read: {e}") from None
    tok.save_pretrained(out)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tok_config = json.load(f)
    template = getattr(tok, "chat_template", None)
    if template:
        tok_config["chat_template"] = template
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(tok_config, f, ensure_ascii=False, indent=1)
    eos = config.get("eos_token_id", tok.eos_token_id)
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": eos, "bos_token_id": config.get("bos_token_id")}, f)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, default=str)
    names = _hf_name_map(out, "llama" if arch == "mistral" else arch)
    with open(os.path.join(out, TENSOR_MAP), "w", encoding="utf-8") as f:
        json.dump(names, f, indent=0)


class GGUFTensorSource:
    """One tensor of a GGUF file, not read yet: ``shape`` is its logical [rows, columns] (torch
    order); ``narrow`` selects rows or whole blocks of columns; ``packed()`` gives the rows'
    blocks as uint8 ``[rows, row_bytes]``; ``full()`` dequantizes (float tensors and the few
    places that need floats: norms, biases, layers kept dense)."""

    def __init__(self, name: str, data: np.ndarray, qtype: int, shape: tuple, row_perm=None) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.name = name
        self.qtype = int(qtype)
        self.type_name = GGMLQuantizationType(self.qtype).name
        self.block_elems, self.block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        self.shape = torch.Size(shape)
        self._data = data  # the file's memory map: [rows, row_bytes] uint8, or the float array itself
        self._rows = row_perm  # a row index array (undoing a permutation / selecting a slice) or None
        self._cols = (0, shape[-1]) if len(shape) == 2 else None

    @property
    def quantized(self) -> bool:
        return self.type_name not in ("F32", "F64")

    def _copy(self, rows, cols, shape) -> "GGUFTensorSource":
        c = object.__new__(GGUFTensorSource)
        c.__dict__.update(self.__dict__)
        c._rows, c._cols, c.shape = rows, cols, torch.Size(shape)
        return c

    def narrow(self, dim: int, start: int, length: int) -> "GGUFTensorSource":
        if dim == 0:
            idx = np.arange(start, start + length) if self._rows is None else self._rows[start:start + length]
            return self._copy(idx, self._cols, (length, *self.shape[1:]))
        if dim != 1 or len(self.shape) != 2:
            raise ValueError(f"{self.name}: cannot narrow dimension {dim} of a {len(self.shape)}-d GGUF tensor")
        if start % self.block_elems or length % self.block_elems:
            raise ValueError(f"{self.name} ({self.type_name}): columns {start}..{start + length} split a block of "
                             f"{self.block_elems}; choose a tensor_parallel_size that divides the blocks")
        c0 = self._cols[0] + start
        return self._copy(self._rows, (c0, c0 + length), (self.shape[0], length))

    def _row_bytes(self) -> np.ndarray:
        """uint8 [rows, row_bytes] of the selected rows (all columns), a view of the map where possible."""
        if self._data.ndim == 1:  # a vector: its "rows" are elements (float types: one per block)
            data = self._data.reshape(-1, self.block_bytes)
            return (data if self._rows is None else data[self._rows]).reshape(1, -1)
        return self._data if self._rows is None else self._data[self._rows]

    def packed(self) -> torch.Tensor:
        """uint8 [rows, row_bytes]: this slice's blocks exactly as they lie in the file."""
        data = self._row_bytes()
        c0, c1 = self._cols if self._cols is not None else (0, 0)
        if self._cols is not None and (c0, c1) != (0, self._data.shape[-1] // self.block_bytes * self.block_elems):
            data = data[:, c0 // self.block_elems * self.block_bytes:c1 // self.block_elems * self.block_bytes]
        return torch.from_numpy(np.array(data, dtype=np.uint8, order="C", copy=True))  # off the read-only map

    def full(self) -> torch.Tensor:
        """float32 in ``shape``: the slice dequantized (F32 / F16 read as they are)."""
        raw = self.packed().numpy()
        if self.type_name == "F32":
            arr = raw.view(np.float32)
        elif self.type_name == "F16":
            arr = raw.view(np.float16).astype(np.float32)
        else:
            from gguf.quants import dequantize

            arr = dequantize(raw, self.qtype)
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.shape)


def _reverse_permute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse permute,
    as an index array over rows)."""
    dim = n_rows // n_head // 2
    idx = np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)
    return idx


def _hf_name_map(meta_dir: str, arch: str) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf's tensor-name tables over the HF model's
    own parameter names (an HF model built on the meta device: no memory; ~10 s, so done once,
    at conversion, and kept in the metadata folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    cfg = AutoConfig.from_pretrained(meta_dir, local_files_only=True)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg.to_dict())
    return get_gguf_hf_weights_map(hf_model, processor)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple  # torch order (GGUF lists dimensions innermost first)
    qtype: int
    offset: int  # from the start of the file


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


def tensor_index(file: str) -> list[TensorInfo]:
    """The tensor table of a GGUF file, metadata values skipped unread (gguf's GGUFReader parses
    every field, the tokenizer's 49k-entry arrays included: seconds per open)."""
    import struct

    with open(file, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{file!r} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise ValueError(f"GGUF file {file!r}: version {version} is not supported (2 or later)")
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 24
        alignment = 32

        def string(p):
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

        def skip(vtype, p):
            if vtype in _SCALAR_SIZES:
                return p + _SCALAR_SIZES[vtype]
            if vtype == 8:
                (n,) = struct.unpack_from("<Q", buf, p)
                return p + 8 + n
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if etype in _SCALAR_SIZES:
                    return p + count * _SCALAR_SIZES[etype]
                for _ in range(count):
                    p = skip(etype, p)
                return p
            raise ValueError(f"GGUF file {file!r}: unknown metadata value type {vtype}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == "general.alignment" and vtype == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            pos = skip(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), int(qtype), int(offset)))
    except struct.error:
        raise ValueError(f"GGUF file {file!r} is truncated (its header ends early)") from None
    finally:
        buf.close()
    start = (pos + alignment - 1) // alignment * alignment
    out = [TensorInfo(name, shape, qtype, start + offset) for name, shape, qtype, offset in infos]
    for t in out:
        if t.offset + _nbytes(t) > size:
            raise ValueError(f"GGUF file {file!r} is truncated: tensor {t.name!r} runs past its end")
    return out


def _nbytes(t: TensorInfo) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {t.name!r}: unknown GGUF tensor type id {t.qtype}") from None
    count = int(np.prod(t.shape)) if t.shape else 1
    return count // elems * nbytes


def _tensor_map(path: str) -> dict[str, str]:
    with open(os.path.join(metadata_dir(path), TENSOR_MAP), encoding="utf-8") as f:
        return json.load(f)


def _hf_tensors(path: str, arch: str) -> Iterator[tuple[str, TensorInfo]]:
    """(HF name, table entry) of every tensor the model loads, in file order."""
    file = find_gguf_file(path)
    names = _tensor_map(path)
    for t in tensor_index(file):
        hf_name = names.get(t.name)
        if hf_name is None:
            if t.name.startswith("rope_freqs") or t.name.endswith(".rope_freqs.weight"):
                continue  # llama.cpp's precomputed rotary factors: ours come from the config
            raise ValueError(f"GGUF file {file!r}: tensor {t.name!r} has no counterpart in {GGUF_ARCHITECTURES[arch]}")
        yield hf_name, t


def gguf_weights(path: str, hf_config) -> Iterator[tuple[str, GGUFTensorSource]]:
    """Every tensor of the GGUF model at ``path`` as (HF name, source over the file's memory
    map), in file order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    arch = hf_config.gguf_architecture
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    mm = np.memmap(find_gguf_file(path), dtype=np.uint8, mode="r")
    for hf_name, t in _hf_tensors(path, arch):
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        raw = mm[t.offset:t.offset + _nbytes(t)]
        data = raw.reshape(t.shape[0], t.shape[1] // elems * nbytes) if len(t.shape) == 2 else raw
        rows = None
        if arch in _PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name) and len(t.shape) == 2:
            rows = _reverse_permute_rows(t.shape[0], heads if ".attn_q." in t.name else kv_heads)
        yield hf_name, GGUFTensorSource(t.name, data, t.qtype, t.shape, rows)


def gguf_quantization(path: str, hf_config, requested: Optional[str]):
    """The quantization of a GGUF model: each HF tensor's block type (no tensor data read).
    ``quantization`` may only be None or "gguf" for one."""
    from pagedllm.quantization.gguf import GGUFQuantConfig

    if requested not in (None, "gguf"):
        raise ValueError(f"quantization={requested!r} was requested but {path!r} is a GGUF file (its blocks are its "
                         "quantization; pass quantization='gguf' or leave it unset)")
    from gguf import GGMLQuantizationType

    # (tensor_index has refused unknown type ids)
    return GGUFQuantConfig({name: GGMLQuantizationType(t.qtype).name
                            for name, t in _hf_tensors(path, hf_config.gguf_architecture)})
