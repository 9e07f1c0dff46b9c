"""Which GGML type each tensor gets when a float checkpoint is quantized:
the per-tensor rules of llama.cpp's `llama_tensor_get_type` for the schemes
Llamba writes (f16, bf16, f32, q8_0, q4_0, q4_k_m, mxfp4_moe), limited to the encoders
that exist here.

A rule names the type llama.cpp would choose; `encodable` then walks
llama.cpp's own fallback chain (for rows that are not whole super-blocks) and,
where a type has no encoder in quant.encode.ENCODERS, the next best one
that does (today every type these schemes name has one: Q8_0, Q4_0, Q4_K,
Q5_0, Q5_K, Q6_K; the fallback table stays for types added to a rule later).
"""
from __future__ import annotations

from .encode import ENCODERS
from .types import BLOCK_LAYOUT, GGMLType

SCHEMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "mxfp4_moe")

# general.file_type values (llama.cpp's llama_ftype)
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15, "bf16": 32, "mxfp4_moe": 38}

_FLOAT = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
# llama.cpp: a K-quant needs whole 256-element rows; otherwise it uses these
_NOT_WHOLE_SUPERBLOCKS = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1,
                          GGMLType.Q6_K: GGMLType.Q8_0}
# no encoder here: the nearest type we can write (never fewer bits for the
# tensors llama.cpp deliberately keeps at higher precision)
_NO_ENCODER = {GGMLType.Q6_K: GGMLType.Q8_0, GGMLType.Q5_K: GGMLType.Q8_0,
               GGMLType.Q5_0: GGMLType.Q4_0, GGMLType.Q5_1: GGMLType.Q4_0}


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp: the first and last eighth of the layers, and every third one between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def encodable(t: GGMLType, ncols: int) -> GGMLType:
    """t, or what llama.cpp / this package falls back to for a row of ncols."""
    for _ in range(4):
        if t in _FLOAT:
            return t
        if ncols % BLOCK_LAYOUT[t][0]:
            t = _NOT_WHOLE_SUPERBLOCKS.get(t, GGMLType.Q8_0 if ncols % 32 == 0 else GGMLType.F16)
            continue
        if t not in ENCODERS:
            t = _NO_ENCODER.get(t, GGMLType.Q8_0)
            continue
        return t
    return GGMLType.F16


def tensor_type(scheme: str, name: str, shape: tuple[int, ...], n_layers: int,
                tied_output: bool) -> GGMLType:
    """GGML type for GGUF tensor `name` of numpy `shape` under `scheme`.
    1-D tensors (norms, biases) stay F32, as llama.cpp keeps them."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme '{scheme}' (have {', '.join(SCHEMES)})")
    if len(shape) < 2 or name.endswith(".ffn_gate_inp.weight"):
        return GGMLType.F32      # a MoE router too: llama.cpp's converter writes it F32 and never quantizes it
    if scheme in ("f32", "f16", "bf16"):
        return GGMLType[scheme.upper()]
    ncols = shape[-1]
    is_output = name == "output.weight" or (tied_output and name == "token_embd.weight")
    if scheme == "q8_0":
        return encodable(GGMLType.Q8_0, ncols)
    if scheme == "mxfp4_moe":
        # llama.cpp's MXFP4_MOE: MoE expert tensors (3-D) MXFP4, every other matrix Q8_0
        return encodable(GGMLType.MXFP4 if len(shape) == 3 else GGMLType.Q8_0, ncols)
    if is_output:
        return encodable(GGMLType.Q6_K, ncols)
    if scheme == "q4_0":
        return encodable(GGMLType.Q4_0, ncols)
    # q4_k_m
    t = GGMLType.Q4_K
    if name.startswith("blk."):
        layer = int(name.split(".")[1])
        if (".attn_v." in name or ".ffn_down." in name or ".ffn_down_exps." in name) \
                and _use_more_bits(layer, n_layers):
            t = GGMLType.Q6_K
    return encodable(t, ncols)
