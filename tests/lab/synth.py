"""Random-weight GGUF models of real shapes, for GPU tests and benchmarks.

Speed does not depend on weight values, and the GPU machine has no network, so
benchmarks build their models there: random quantized blocks whose f16 scale
fields are overwritten with small sane values (so activations stay finite),
written with gguf's GGUFWriter and loaded through the normal loader.
No CuPy needed here.  Tensors are streamed to the file as they are made: one at a
time into reused buffers, or, for files of PARALLEL_BYTES and more (an M30 file is
~17 GiB), by a thread a core, each writing its tensors at their offsets (fresh memory
and page cache, not the bytes, set the time: a core each fills them at once).  `python -m lab.synth SHAPE OUT.gguf [--mix Q4_K_M] [--tokenizer TOK]`
writes one (tests on PYTHONPATH).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from quant import GGMLType, QTensor, row_nbytes

# (offset, kind) of the f16 scale fields in each block, and the value they get
_SCALES = {
    GGMLType.Q4_0: [(0, "d")], GGMLType.Q4_1: [(0, "d"), (2, "m")],
    GGMLType.Q5_0: [(0, "d")], GGMLType.Q5_1: [(0, "d"), (2, "m")],
    GGMLType.Q8_0: [(0, "d8")], GGMLType.Q4_K: [(0, "dk"), (2, "dk")],
    GGMLType.Q5_K: [(0, "dk"), (2, "dk")], GGMLType.Q6_K: [(208, "d6")],
}
_BLOCK = {GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22),
          GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q4_K: (256, 144),
          GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.MXFP4: (32, 17)}


# files at least this big are made by a thread a core (each tensor its own random draws:
# other values than one thread's, for the same seed)
PARALLEL_BYTES = 2 << 30


class _Noise:
    """Random bytes, made fast by tiling one random pattern (values don't matter for speed)."""

    def __init__(self, seed=0, pattern_bytes=1 << 24, pattern=None):
        self.rng = np.random.default_rng(seed)
        self.pattern = self.rng.integers(0, 256, pattern_bytes, dtype=np.uint8) if pattern is None else pattern

    def bytes(self, n: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(n, np.uint8) if out is None else out[:n]
        P = self.pattern.size
        for o in range(0, n, P):
            k = min(P, n - o)
            start = int(self.rng.integers(0, P - k + 1))
            out[o:o + k] = self.pattern[start:start + k]
        return out


def random_weight(qtype, shape, noise: _Noise | None = None, std: float = 0.02, out=None) -> np.ndarray:
    """uint8 [rows, row_nbytes] of random blocks of `qtype` whose weights have roughly `std`
    (in `out`'s memory when given: a uint8 buffer of at least that many bytes)."""
    noise = noise or _Noise()
    qtype = GGMLType(int(qtype))
    rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
    if qtype == GGMLType.F32:
        x = (noise.rng.standard_normal((rows, cols), dtype=np.float32) * std)
        return x.view(np.uint8).reshape(rows, -1)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        # random sign and mantissa, exponent of std or twice it: as fast as the noise
        # (an 8B model's normal draws would take minutes)
        e = int(np.floor(np.log2(std)))
        bits = noise.bytes(rows * cols * 2, out).view(np.uint16)
        # kept: the sign, the mantissa and the exponent's lowest bit; set: its others
        if qtype == GGMLType.F16:            # 1 sign, 5 exponent (bias 15), 10 mantissa bits
            bits &= 0x87FF
            bits |= ((e + 15) & ~1) << 10
        else:                                 # 1 sign, 8 exponent (bias 127), 7 mantissa bits
            bits &= 0x80FF
            bits |= ((e + 127) & ~1) << 7
        return bits.view(np.uint8).reshape(rows, -1)
    qk, bb = _BLOCK[qtype]
    nblocks = rows * cols // qk
    raw = noise.bytes(nblocks * bb, out).reshape(nblocks, bb)
    # scales for roughly `std`: q spans ~16 levels (Q4), ~32 (Q5), ~256 (Q8); K-quant
    # sub-scales are 6-bit (mean ~32); Q6_K sub-scales are set to 1..16 below
    vals = {"d": std / 5, "m": -std * 1.5, "d8": std / 70, "dk": std / 150, "d6": std / 160}
    if qtype == GGMLType.MXFP4:
        # E8M0 exponent byte: values kvalue * 2^(e - 128), kvalues (|v| <= 12) spread ~6
        e = 128 + int(np.floor(np.log2(std / 6)))
        raw[:, 0] = e + noise.rng.integers(0, 2, nblocks, dtype=np.uint8)
    for off, kind in _SCALES.get(qtype, ()):
        jitter = (0.5 + noise.rng.random(nblocks, dtype=np.float32)).astype(np.float32)
        raw[:, off:off + 2] = (jitter * vals[kind]).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    if qtype == GGMLType.Q6_K:
        raw[:, 192:208] = noise.rng.integers(1, 17, (nblocks, 16), dtype=np.uint8)
    return raw.reshape(rows, row_nbytes(qtype, cols))


# llama.cpp's Q4_K_M: Q4_K everywhere but Q6_K for the output/embedding and for
# attn_v / ffn_down (experts' too: llama-quant.cpp matches "ffn_down" in the name) in the
# first and last eighth of the layers and every third between
def _q4_k_m(name: str, n_layers: int) -> GGMLType:
    if name in ("token_embd.weight", "output.weight"):
        return GGMLType.Q6_K
    if name.endswith("attn_v.weight") or name.endswith(("ffn_down.weight", "ffn_down_exps.weight")):
        i = int(name.split(".")[1])
        if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2:
            return GGMLType.Q6_K
    return GGMLType.Q4_K


# K-quants need rows of whole 256-blocks; llama.cpp's types for narrower ones
_K_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}


def mix_type(mix: str, name: str, n_layers: int, cols: int) -> GGMLType:
    """The type of matrix `name` with rows of `cols` values in quantization mix `mix`
    (MXFP4_MOE: llama.cpp's, gpt-oss's files: experts MXFP4, other matrices Q8_0)."""
    if mix == "MXFP4_MOE":
        return GGMLType.MXFP4 if "_exps." in name else GGMLType.Q8_0
    t = _q4_k_m(name, n_layers) if mix == "Q4_K_M" else GGMLType[mix]
    if cols % 256 and t in _K_FALLBACK:         # as llama.cpp quantizes such rows (Qwen2.5-0.5B: 896)
        t = _K_FALLBACK[t]
    return t


SHAPES = {
    # the benchmark shapes
    "Q15": dict(arch="qwen2", n_layers=28, d_model=1536, d_ff=8960, n_heads=12, n_kv_heads=2,
                vocab=151936, tied=True, rope_theta=1e6),
    "L8": dict(arch="llama", n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8,
               vocab=128256, tied=False, rope_theta=5e5),
    # Gemma 3 1B's attention (4 query heads of dim 256, one KV head) on a llama body: the
    # prompt attention kernels at head dim 256 (bench_gpu_prefill)
    "H256": dict(arch="llama", n_layers=26, d_model=1024, d_ff=6912, n_heads=4, n_kv_heads=1,
                 vocab=32000, tied=True, rope_theta=1e6),
    # Q15's draft in the speculative pair (Qwen2.5-Coder-0.5B)
    "Q05": dict(arch="qwen2", n_layers=24, d_model=896, d_ff=4864, n_heads=14, n_kv_heads=2,
                vocab=151936, tied=False, rope_theta=1e6),
    # issue 40's CPU pair: a Qwen3-MoE of 1.8B parameters (128 experts, 8 a token: 0.3B
    # active) and a dense Qwen3 of Qwen3-0.6B's layers (head dim 64 here, 128 there)
    "M18": dict(arch="qwen3moe", n_layers=16, d_model=1024, d_ff=0, n_heads=16, n_kv_heads=4,
                vocab=151936, tied=True, rope_theta=1e6, n_experts=128, n_experts_used=8, d_ff_expert=256),
    "Q3D": dict(arch="qwen3", n_layers=28, d_model=1024, d_ff=3072, n_heads=16, n_kv_heads=8,
                vocab=151936, tied=True, rope_theta=1e6),
    # issue 40's GPU MoE: Qwen3-30B-A3B (48 layers, d 2048, 32 q / 4 kv heads of 128, 128
    # experts of 768, 8 a token; 30.5B parameters, 3.3B active); Q4_K_M ~17.3 GiB
    "M30": dict(arch="qwen3moe", n_layers=48, d_model=2048, d_ff=0, n_heads=32, n_kv_heads=4,
                vocab=151936, tied=False, rope_theta=1e6, n_experts=128, n_experts_used=8, d_ff_expert=768,
                head_dim=128),
    # gpt-oss-20b's shape on a qwen3moe body (for MXFP4_MOE until the gpt-oss family runs):
    # 24 layers, d_model 2880, 64 query / 8 KV heads of 64, 32 experts of 2880, 4 a token,
    # vocabulary 201088 (its attention sinks, biases and sliding windows aside).  GO4: its first
    # 4 layers and SmolLM2's 49152-token vocabulary (CPU benches: tokenizer_from=SmolLM2's GGUF).
    "GO20": dict(arch="qwen3moe", n_layers=24, d_model=2880, d_ff=0, n_heads=64, n_kv_heads=8,
                 vocab=201088, tied=False, rope_theta=15e4, n_experts=32, n_experts_used=4, d_ff_expert=2880,
                 head_dim=64),
    "GO4": dict(arch="qwen3moe", n_layers=4, d_model=2880, d_ff=0, n_heads=64, n_kv_heads=8,
                vocab=49152, tied=False, rope_theta=15e4, n_experts=32, n_experts_used=4, d_ff_expert=2880,
                head_dim=64),
    # gpt-oss-20b itself (the gpt-oss family: sinks, biases, a 128-token window every other
    # layer; without its YaRN scaling, which changes no speed): as GO20, mix MXFP4_MOE
    "G20": dict(arch="gpt-oss", n_layers=24, d_model=2880, d_ff=2880, n_heads=64, n_kv_heads=8,
                vocab=201088, tied=False, rope_theta=150000.0, n_experts=32, n_experts_used=4, d_ff_expert=2880,
                head_dim=64, sliding_window=128),
}


def write_random_gguf(path, arch, n_layers, d_model, d_ff, n_heads, n_kv_heads, vocab, tied,
                      mix="Q4_K_M", rope_theta=1e4, ctx=4096, seed=0, n_experts=0, n_experts_used=0,
                      d_ff_expert=0, tokenizer_from=None, head_dim=None, sliding_window=0):
    """A random-weight GGUF of this shape and quantization mix at `path`.  arch qwen3moe:
    n_experts experts of d_ff_expert a layer, n_experts_used a token, an F32 router whose
    logits have a spread of about 1 (clear choices, as a trained router's).  arch gpt-oss
    (the same experts, with biases; q/k/v/o biases, attention sinks of spread 1, a window
    of sliding_window in every other layer).  tokenizer_from:
    a GGUF whose tokenizer.* keys (vocabulary, merges, chat template) the file gets, so the
    CLI, the server and constraints run on it (its vocabulary should have `vocab` tokens or
    fewer).  head_dim: when it is not d_model / n_heads (Qwen3's 128 at d 2048, 32 heads)."""
    import gguf
    noise = _Noise(seed)
    hd = head_dim or d_model // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random {arch} {n_layers}x{d_model} {mix}")
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    if hd != d_model // n_heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(n_experts_used)
        w.add_expert_feed_forward_length(d_ff_expert)
    if arch == "gpt-oss":
        w.add_sliding_window(sliding_window)
    if tokenizer_from is not None:
        r = gguf.GGUFReader(str(tokenizer_from))
        for key, f in r.fields.items():
            if key.startswith("tokenizer."):
                vtype = f.types[0]
                value = f.contents()
                # a vocabulary larger than the tokenizer's (gpt-oss-20b's 201088 rows with Qwen's
                # 151936 tokens): unused padding tokens, so llama.cpp's row check holds too
                if key == "tokenizer.ggml.tokens" and vocab > len(value):
                    value = value + [f"<|llamba_pad_{i}|>" for i in range(vocab - len(value))]
                elif key == "tokenizer.ggml.token_type" and vocab > len(value):
                    value = value + [5] * (vocab - len(value))          # LLAMA_TOKEN_TYPE_UNUSED
                elif key == "tokenizer.ggml.scores" and vocab > len(value):
                    value = value + [0.0] * (vocab - len(value))
                w.add_key_value(key, value, vtype,
                                sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)

    # each tensor: its info now, its bytes made when written (in this order: the noise's
    # draws are those of making them all first)
    tensors = []

    def mat(name, rows, cols, n=0, t=None, std=0.02):
        t = t if t is not None else mix_type(mix, name, n_layers, cols)
        rb = row_nbytes(t, cols)
        shape = (n, rows, rb) if n else (rows, rb)

        def make(buf, noise, t=t, rows=rows, cols=cols, n=n, std=std, shape=shape):
            return random_weight(t, (max(n, 1) * rows, cols), noise, std, out=buf).reshape(shape)
        tensors.append((name, shape, np.dtype(np.uint8), int(np.prod(shape)), gguf.GGMLQuantizationType(int(t)), make))

    def vec(name, n, value=None, std=0.02):
        shape = n if isinstance(n, tuple) else (n,)

        def make(buf, noise, shape=shape, value=value, std=std):
            return (np.full(shape, value, np.float32) if value is not None else
                    noise.rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        tensors.append((name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)), None, make))

    mat("token_embd.weight", vocab, d_model)
    vec("output_norm.weight", d_model, 1.0)
    if not tied:
        mat("output.weight", vocab, d_model)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d_model, 1.0)
        vec(p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight"), d_model, 1.0)
        mat(p + "attn_q.weight", n_heads * hd, d_model)
        mat(p + "attn_k.weight", n_kv_heads * hd, d_model)
        mat(p + "attn_v.weight", n_kv_heads * hd, d_model)
        mat(p + "attn_output.weight", d_model, n_heads * hd)
        if arch in ("qwen2", "gpt-oss"):
            vec(p + "attn_q.bias", n_heads * hd)
            vec(p + "attn_k.bias", n_kv_heads * hd)
            vec(p + "attn_v.bias", n_kv_heads * hd)
        if arch == "gpt-oss":
            vec(p + "attn_output.bias", d_model)
            vec(p + "attn_sinks.weight", n_heads, std=1.0)
            mat(p + "ffn_gate_inp.weight", n_experts, d_model, t=GGMLType.F32, std=d_model ** -0.5)
            vec(p + "ffn_gate_inp.bias", n_experts, std=0.1)
            mat(p + "ffn_gate_exps.weight", d_ff_expert, d_model, n_experts)
            mat(p + "ffn_up_exps.weight", d_ff_expert, d_model, n_experts)
            mat(p + "ffn_down_exps.weight", d_model, d_ff_expert, n_experts)
            for part, cols in (("gate", d_ff_expert), ("up", d_ff_expert), ("down", d_model)):
                vec(p + f"ffn_{part}_exps.bias", (n_experts, cols))
            continue
        if arch in ("qwen3", "qwen3moe"):
            vec(p + "attn_q_norm.weight", hd, 1.0)
            vec(p + "attn_k_norm.weight", hd, 1.0)
        if arch == "qwen3moe":
            mat(p + "ffn_gate_inp.weight", n_experts, d_model, t=GGMLType.F32, std=d_model ** -0.5)
            mat(p + "ffn_gate_exps.weight", d_ff_expert, d_model, n_experts)
            mat(p + "ffn_up_exps.weight", d_ff_expert, d_model, n_experts)
            mat(p + "ffn_down_exps.weight", d_model, d_ff_expert, n_experts)
            continue
        mat(p + "ffn_gate.weight", d_ff, d_model)
        mat(p + "ffn_up.weight", d_ff, d_model)
        mat(p + "ffn_down.weight", d_model, d_ff)
    for name, shape, dtype, nbytes, raw, _ in tensors:
        w.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(t[3] for t in tensors)
    if total >= PARALLEL_BYTES:
        _write_parallel(w, path, tensors, noise.pattern, seed)
        return Path(path)
    bufs = {}                   # bytes -> a buffer reused by every tensor of that size
    for name, shape, dtype, nbytes, raw, make in tensors:
        buf = bufs.get(nbytes)
        if buf is None and nbytes >= 1 << 20:
            buf = bufs[nbytes] = np.empty(nbytes, np.uint8)
        a = make(buf, noise)
        assert a.nbytes == nbytes, (name, a.shape, nbytes)
        w.write_tensor_data(a)
    w.close()
    return Path(path)


def _write_parallel(w, path, tensors, pattern, seed, workers=None):
    """The tensors' bytes at the offsets GGUFWriter gave them (after its tensor infos, each
    padded to its alignment), made and written by `workers` threads (a core each: NumPy's
    fills and copies and pwrite run without the GIL), tensor i from its own noise."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor
    align = w.data_alignment
    pad = lambda n: -(-n // align) * align
    fout = w.fout[0]
    o = pad(fout.tell())
    offsets = []
    for t in tensors:
        offsets.append(o)
        o += pad(t[3])
    w.close()
    local = threading.local()
    fd = os.open(str(path), os.O_WRONLY)
    try:
        os.ftruncate(fd, o)

        def one(i):
            name, shape, dtype, nbytes, raw, make = tensors[i]
            bufs = getattr(local, "bufs", None)
            if bufs is None:
                bufs = local.bufs = {}
            buf = bufs.get(nbytes)
            if buf is None and nbytes >= 1 << 20:
                buf = bufs[nbytes] = np.empty(nbytes, np.uint8)
            a = np.ascontiguousarray(make(buf, _Noise((seed, i), pattern=pattern)))
            assert a.nbytes == nbytes, (name, a.shape, nbytes)
            mv, done = memoryview(a.reshape(-1).view(np.uint8)), 0
            while done < nbytes:
                done += os.pwrite(fd, mv[done:], offsets[i] + done)

        with ThreadPoolExecutor(workers or os.cpu_count() or 4) as ex:
            # largest first, so the pool ends evenly
            for f in [ex.submit(one, i) for i in sorted(range(len(tensors)), key=lambda i: -tensors[i][3])]:
                f.result()
    finally:
        os.close(fd)


def load_weights_only(path):
    """A LoadedModel without a tokenizer (random and trimmed test models carry none)."""
    from models import config_from_gguf
    from runtime.gguf_file import GGUFFile
    from runtime.loaded_model import LoadedModel
    g = GGUFFile(path)
    shapes = {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(g.metadata, shapes)
    tensors = {n: QTensor.from_file_bytes(n, t.ggml_type, t.shape, g.tensor_bytes(n)) for n, t in g.tensors.items()}
    return LoadedModel(path=Path(path), config=cfg, tensors=tensors, tokenizer=None, metadata=g.metadata)


def trim_gguf(src, dst, n_layers: int, vocab: int, keep_tokenizer: bool = False):
    """A copy of a real GGUF with only its first n_layers layers and first `vocab`
    embedding/output rows (real weights, small enough to carry to a GPU machine)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key.startswith("tokenizer.") and not keep_tokenizer:
            continue
        val = f.contents()
        if key == f"{arch}.block_count":
            val = n_layers
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        data = np.asarray(t.data)
        if t.name in ("token_embd.weight", "output.weight"):
            data = data[:vocab]
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    import argparse
    import time
    ap = argparse.ArgumentParser(description="write a random-weight GGUF of a real shape")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--tokenizer", default=None, help="a GGUF whose tokenizer.* keys the file gets "
                    "(llama.cpp loads no file without them; tests/gpu/prepare_device.py's qwen-tok.tok)")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    p = write_random_gguf(a.out, mix=a.mix, tokenizer_from=a.tokenizer, **SHAPES[a.shape])
    print(f"{p}: {p.stat().st_size / 2**30:.2f} GiB written in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
