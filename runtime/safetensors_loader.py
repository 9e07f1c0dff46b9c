"""Hugging Face checkpoint folders: config.json, one or many *.safetensors
shards (with model.safetensors.index.json), tokenizer.json and
tokenizer_config.json / chat_template.jinja.

Shards are opened with the `safetensors` package, which validates each header
(dtypes, shapes, and that the byte ranges tile the file).  Its numpy reader
copies tensors and knows no bfloat16, so the bytes themselves are taken from
one read-only np.memmap per shard, at the offsets the header gives: a tensor
that needs no change (no quantization, no layout fix) is never copied.
bf16 is read through an ml_dtypes view.

Without `quant`, matrices keep their stored dtype (F16 / BF16 / F32 QTensors);
with quant="int8" or "int4" they are encoded on load into GGML blocks (see
QUANT_SCHEMES), with a progress bar.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from models import MOE_ARCHS, tensor_shapes, unfuse
from models.hf_config import (CheckpointError, config_from_hf, expert_name, fix_layout, gguf_name, hf_arch,
                              layout_changes, mxfp4_parts, parts)
from quant import GGMLType, QTensor, quantize
from quant.policy import tensor_type

from .loaded_model import LoadedModel

# --quant value -> quantization scheme (quant.policy).  int4 is the Q4_K_M mix, not
# plain Q4_0: perplexity on GPL-3 (c=512) went 18.33 -> 20.82 (q4_k_m) vs 22.70 (q4_0)
# for SmolLM2-135M and 6.23 -> 7.60 vs 8.09 for Qwen2.5-Coder-0.5B, for 7% more bytes.
QUANT_SCHEMES = {"none": None, "int8": "q8_0", "int4": "q4_k_m"}

_DTYPES = {"F32": (np.dtype(np.float32), GGMLType.F32),
           "F16": (np.dtype(np.float16), GGMLType.F16),
           "BF16": (np.dtype(ml_dtypes.bfloat16), GGMLType.BF16),
           # gpt-oss's MXFP4 experts (PackedMXFP4: made of a *_blocks and a *_scales tensor)
           "MXFP4": (np.dtype(np.uint8), GGMLType.MXFP4)}
_MAX_HEADER = 100 * 1024 * 1024


class Shard:
    """One .safetensors file: header validated by `safetensors`, bytes memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            from safetensors import safe_open
            with safe_open(str(path), framework="numpy") as f:
                keys = set(f.keys())
        except Exception as e:   # safetensors raises its own SafetensorError type
            size = path.stat().st_size if path.exists() else 0
            raise CheckpointError(f"{path.name}: not a readable safetensors file "
                                  f"({size} bytes; truncated or corrupt?): {e}") from None
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path.name}: header of {n} bytes is implausible")
            header = json.loads(fh.read(n))
        self.meta = header.pop("__metadata__", None) or {}
        self.entries = header
        if set(header) != keys:
            raise CheckpointError(f"{path.name}: header disagrees with the safetensors reader")
        self.data_start = 8 + n
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size > self.data_start else None

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self.entries[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a read-only view of the memory map)."""
        a, b = self.entries[name]["data_offsets"]
        return self._map[self.data_start + a:self.data_start + b]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a numpy array of its stored dtype (bf16: ml_dtypes), zero-copy."""
        dt = self.dtype_name(name)
        if dt not in _DTYPES:
            raise CheckpointError(f"{self.path.name}: tensor '{name}' is stored as {dt}; "
                                  f"Llamba reads float checkpoints only (F32, F16, BF16)")
        return self.raw(name).view(_DTYPES[dt][0]).reshape(self.shape(name))

    def nbytes(self, name: str) -> int:
        a, b = self.entries[name]["data_offsets"]
        return b - a


class ExpertStack:
    """A layer's experts, one HF tensor each, as the one 3-D tensor GGUF stores
    [n_experts, rows, cols]: read through the Shard interface under a name of its own
    (`model.layers.N.mlp.experts.*.gate_proj.weight`); its bytes are the experts' bytes
    one after the other (a copy: they lie apart in the shards)."""

    def __init__(self, parts: list[tuple[Shard, str]]):
        self.parts = parts
        self.path = parts[0][0].path
        shapes = {s.shape(h) for s, h in parts}
        dtypes = {s.dtype_name(h) for s, h in parts}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise CheckpointError(f"{self.path.name}: the experts of '{parts[0][1]}' differ in shape or dtype "
                                  f"({sorted(shapes)}, {sorted(dtypes)})")
        self._shape = (len(parts),) + shapes.pop()
        self._dtype = dtypes.pop()

    def dtype_name(self, name: str) -> str:
        return self._dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape

    def array(self, name: str) -> np.ndarray:
        return np.stack([s.array(h) for s, h in self.parts])

    def raw(self, name: str) -> np.ndarray:
        out = np.empty(sum(s.nbytes(h) for s, h in self.parts), np.uint8)
        o = 0
        for s, h in self.parts:
            b = s.raw(h)
            out[o:o + b.size] = b
            o += b.size
        return out

    def nbytes(self, name: str) -> int:
        return sum(s.nbytes(h) for s, h in self.parts)


class Cut:
    """A GGUF tensor cut from an HF tensor that stores it differently (models.hf_config.Part:
    gpt-oss's experts, transposed, gate and up interleaved), read through the Shard
    interface; its bytes are a copy, in the stored dtype."""

    def __init__(self, shard: Shard, hf_name: str, part):
        self.shard, self.hf_name, self.part = shard, hf_name, part
        self.path = shard.path

    def dtype_name(self, name: str) -> str:
        return self.shard.dtype_name(self.hf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.part.shape(self.shard.shape(self.hf_name))

    def array(self, name: str) -> np.ndarray:
        return self.part.apply(self.shard.array(self.hf_name))

    def raw(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.array(name)).reshape(-1).view(np.uint8)

    def nbytes(self, name: str) -> int:
        return self.shard.nbytes(self.hf_name) * int(np.prod(self.shape(name))) // \
            max(1, int(np.prod(self.shard.shape(self.hf_name))))


class PackedMXFP4:
    """An MXFP4 expert tensor of gpt-oss's checkpoint (`*_blocks` and `*_scales`, models.
    hf_config.mxfp4_parts) as GGML MXFP4 blocks [E, rows, cols], read through the Shard
    interface: bits moved only (quant.encode.mxfp4_from_packed), every other row from
    `start` where gate and up share the tensor.  `array` dequantizes (to requantize it)."""

    def __init__(self, blocks: tuple[Shard, str], scales: tuple[Shard, str], start: int | None):
        self.blocks, self.scales, self.start = blocks, scales, start
        self.path = blocks[0].path
        (bs, bn), (ss, sn) = blocks, scales
        b, sc = bs.shape(bn), ss.shape(sn)
        if bs.dtype_name(bn) != "U8" or ss.dtype_name(sn) != "U8" or len(b) != 4 or b[3] != 16 or b[:3] != sc:
            raise CheckpointError(f"{self.path.name}: '{bn}' {bs.dtype_name(bn)} {list(b)} and '{sn}' "
                                  f"{ss.dtype_name(sn)} {list(sc)} are not MXFP4 blocks and their scales")
        rows = b[1] if start is None else (b[1] - start + 1) // 2
        self._shape = (b[0], rows, b[2] * 32)

    def dtype_name(self, name: str) -> str:
        return "MXFP4"

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape

    def check(self, name: str) -> None:
        """(the shapes and dtypes were checked when it was made)"""

    def raw(self, name: str) -> np.ndarray:
        from quant.encode import mxfp4_from_packed
        (bs, bn), (ss, sn) = self.blocks, self.scales
        b = bs.raw(bn).reshape(bs.shape(bn))
        sc = ss.raw(sn).reshape(ss.shape(sn))
        if self.start is not None:
            b, sc = b[:, self.start::2], sc[:, self.start::2]
        E, rows, cols = self._shape
        return mxfp4_from_packed(b.reshape(E * rows, -1), sc.reshape(E * rows, -1)).reshape(-1)

    def array(self, name: str) -> np.ndarray:
        from quant import dequantize
        E, rows, cols = self._shape
        t = QTensor(name, GGMLType.MXFP4, (E * rows, cols), self.raw(name).reshape(E * rows, -1))
        return dequantize(t).reshape(self._shape)

    def nbytes(self, name: str) -> int:
        E, rows, cols = self._shape
        return E * rows * cols // 32 * 17


def _stack_experts(experts: dict[str, dict[int, tuple[Shard, str]]], sources: dict) -> None:
    """GGUF name -> ExpertStack of experts 0..E-1 (each present once) into sources."""
    for g, by_index in experts.items():
        n = len(by_index)
        if sorted(by_index) != list(range(n)):
            missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
            raise CheckpointError(f"checkpoint lacks expert {missing[0]} of {g} (experts are numbered 0..E-1)")
        parts = [by_index[e] for e in range(n)]
        sources[g] = (ExpertStack(parts), parts[0][1].replace(".experts.0.", ".experts.*."))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent}: no {path.name} (not a Hugging Face checkpoint folder?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def open_shards(folder: Path) -> dict[str, Shard]:
    """HF tensor name -> the shard that holds it, checked against the index if there is one."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files")
    shards = {}
    for fname in files:
        p = folder / fname
        if not p.is_file():
            raise CheckpointError(f"{folder}: shard {fname} named in the index is missing")
        shards[fname] = Shard(p)
    where: dict[str, Shard] = {}
    for s in shards.values():
        for name in s.entries:
            if name in where:
                raise CheckpointError(f"tensor '{name}' is in both {where[name].path.name} and {s.path.name}")
            where[name] = s
    if weight_map is not None:
        for name, fname in weight_map.items():
            if where.get(name) is not shards[fname]:
                raise CheckpointError(f"tensor '{name}' is listed in {fname} by the index but not found there")
    return where


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of every tensor the model needs."""
    return tensor_shapes(cfg)


class Checkpoint:
    """An opened checkpoint folder: config, tensor sources in GGUF naming, checked shapes."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.hf_config = _read_json(self.folder / "config.json")
        arch = hf_arch(self.hf_config)           # unknown architectures fail before any shard is read
        where = open_shards(self.folder)
        self.sources: dict[str, tuple[Shard, str]] = {}   # GGUF name -> (shard, HF name)
        experts: dict[str, dict[int, tuple[Shard, str]]] = {}
        for hf_name, shard in where.items():
            packed = mxfp4_parts(hf_name, arch)
            if packed is not None:
                sn = hf_name.removesuffix("_blocks") + "_scales"
                if sn not in where:
                    raise CheckpointError(f"{self.folder}: '{hf_name}' without its '{sn}'")
                for g, start in packed:
                    self.sources[g] = (PackedMXFP4((shard, hf_name), (where[sn], sn), start), hf_name)
                continue
            if hf_name.endswith("_scales") and mxfp4_parts(hf_name.removesuffix("_scales") + "_blocks", arch):
                continue        # (read with its *_blocks)
            ex = expert_name(hf_name) if arch in MOE_ARCHS else None
            if ex is not None:
                experts.setdefault(ex[0], {})[ex[1]] = (shard, hf_name)
                continue
            cuts = parts(hf_name, arch)
            if cuts is not None:
                for g, part in cuts:
                    self.sources[g] = (Cut(shard, hf_name, part), hf_name)
                continue
            g = gguf_name(hf_name, arch)
            if g is not None:
                self.sources[g] = (shard, hf_name)
        _stack_experts(experts, self.sources)
        shapes = {g: s.shape(h) for g, (s, h) in self.sources.items()}
        self.config = config_from_hf(self.hf_config, shapes)
        if self.config.tied_output and self.hf_config.get("tie_word_embeddings") is False:
            raise CheckpointError(f"{self.folder}: checkpoint lacks tensor 'lm_head.weight' "
                                  f"(config.json says the output is not tied to the embeddings)")
        want = expected_shapes(self.config)
        for g, shape in want.items():
            if g not in self.sources:
                raise CheckpointError(f"{self.folder}: checkpoint lacks tensor {hf_name_for(g, self)} "
                                      f"({g}) that a {self.config.arch} model with this config.json needs")
            s, h = self.sources[g]
            if s.shape(h) != shape:
                raise CheckpointError(f"{s.path.name}: tensor '{h}' has shape {list(s.shape(h))}, "
                                      f"config.json implies {list(shape)}")
            s.check(h) if hasattr(s, "check") else s.array(h)   # dtype check up front, before any work
        extra = sorted(set(self.sources) - set(want))
        if extra:
            raise CheckpointError(f"{self.folder}: unexpected tensors for {self.config.arch}: "
                                  f"{', '.join(self.sources[g][1] for g in extra[:5])}")
        self.stored_types = {g: _DTYPES[s.dtype_name(h)][1] for g, (s, h) in self.sources.items()}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def float32(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in GGUF layout (q/k permuted, gemma norms + 1)."""
        s, h = self.sources[name]
        return fix_layout(name, s.array(h).astype(np.float32), self.config)

    def tensor(self, name: str, qtype: GGMLType) -> QTensor:
        """QTensor of `name` in `qtype`: the memory-mapped bytes when nothing
        changes, else converted (and encoded) in memory."""
        s, h = self.sources[name]
        shape = s.shape(h)
        if qtype == self.stored_types[name] and not layout_changes(name, self.config):
            return QTensor.from_file_bytes(name, qtype, shape, s.raw(h))
        x = self.float32(name)
        return QTensor(name, qtype, shape, quantize(x.reshape(-1, shape[-1]), qtype))

    def nbytes(self, name: str) -> int:
        s, h = self.sources[name]
        return s.nbytes(h)


def hf_name_for(gguf: str, ck: Checkpoint) -> str:
    """HF name of a GGUF tensor name, for error messages."""
    from models.hf_config import _GLOBAL_NAMES, _LAYER_NAMES, _LAYER_NAMES_BY_ARCH
    for k, v in _GLOBAL_NAMES.items():
        if v == gguf:
            return f"'{k}'"
    if gguf.startswith("blk."):
        _, i, part, kind = gguf.split(".", 3)
        table = {**_LAYER_NAMES, **_LAYER_NAMES_BY_ARCH[ck.config.arch]}
        for k, v in table.items():
            if v == part:
                return f"'model.layers.{i}.{k}.{kind}'"
    return f"'{gguf}'"


def load_type(ck: Checkpoint, name: str, scheme: str | None) -> GGMLType:
    """The type a tensor gets when loaded: its stored dtype (1-D: F32) or the scheme's."""
    if scheme is None:
        return GGMLType.F32 if len(ck.sources[name][0].shape(ck.sources[name][1])) < 2 \
            else ck.stored_types[name]
    shape = ck.sources[name][0].shape(ck.sources[name][1])
    return tensor_type(scheme, name, shape, ck.config.n_layers, ck.config.tied_output)


def load_checkpoint(folder, quant: str | None = None, progress: bool | None = None):
    """LoadedModel from a checkpoint folder; quant: None/"none", "int8" or "int4"."""
    from .tokenizer import Tokenizer

    if quant not in QUANT_SCHEMES and quant is not None:
        raise ValueError(f"--quant must be one of {', '.join(QUANT_SCHEMES)}, not '{quant}'")
    scheme = QUANT_SCHEMES.get(quant) if quant else None
    folder = Path(folder)
    ck = Checkpoint(folder)
    tensors = {}
    names = ck.names
    bar = None
    if scheme is not None:
        from tqdm import tqdm
        total = sum(ck.nbytes(n) for n in names)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"quantizing to {quant} ({scheme})",
                   disable=(progress is False) or (progress is None and not sys.stderr.isatty()),
                   file=sys.stderr)
    try:
        for n in names:
            tensors[n] = ck.tensor(n, load_type(ck, n, scheme))
            if bar is not None:
                bar.update(ck.nbytes(n))
    finally:
        if bar is not None:
            bar.close()
    tensors = unfuse(ck.config, tensors)
    tok = Tokenizer.from_hf_files(folder)
    meta = {"general.architecture": ck.config.arch, "general.name": ck.config.name,
            "llamba.source": "safetensors", "llamba.quant": quant or "none"}
    return LoadedModel(path=folder, config=ck.config, tensors=tensors, tokenizer=tok, metadata=meta,
                       chat_template=getattr(tok, "chat_template", None))
