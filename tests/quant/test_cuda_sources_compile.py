"""The CUDA sources compile for the oldest GPUs Llamba supports (sm_75) and for Hopper,
without a GPU: NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel, CUDA's headers from
`nvidia-cuda-runtime-cu12` (pip install -e '.[cuda-dev]').  Skipped where they are not
installed; the kernels' results are tested on a GPU (tests/gpu)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUANT_CUDA = ROOT / "quant" / "cuda"
BACKEND = ROOT / "runtime" / "backend"

# each block format's struct in qblocks.cuh
STRUCTS = ["TQ4_0", "TQ4_1", "TQ5_0", "TQ5_1", "TQ8_0", "TQ4_K", "TQ5_K", "TQ6_K", "TMXFP4", "TF32", "TF16", "TBF16"]
# the integer decode path's (quant.cuda.INT8_STRUCT)
INT8_STRUCTS = ["IQ4_0", "IQ4_1", "IQ5_0", "IQ5_1", "IQ8_0", "IQ4_K", "IQ5_K", "IQ6_K", "IMXFP4"]
ARCHS = ["compute_75", "compute_90"]


def _nvrtc():
    try:
        import nvidia.cuda_nvrtc
        import nvidia.cuda_runtime
    except ImportError:
        pytest.skip("NVRTC not installed (pip install -e '.[cuda-dev]')")
    lib_dir = Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib"
    libs = sorted(lib_dir.glob("libnvrtc.so*")) + sorted(lib_dir.glob("nvrtc64*.dll"))
    include = Path(list(nvidia.cuda_runtime.__path__)[0]) / "include"
    if not libs or not (include / "cuda_fp16.h").exists():
        pytest.skip("NVRTC wheel without its library or CUDA headers")
    return ctypes.CDLL(str(libs[0])), include


def _compile(source: Path, arch: str, options=(), names=()) -> str:
    """NVRTC's log; fails the test on an error."""
    lib, include = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None) == 0
    try:
        for n in names:
            assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0
        opts = [f"-arch={arch}", "-std=c++17", f"-I{include}", f"-I{QUANT_CUDA}", f"-I{BACKEND}", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        assert rc == 0, f"{source.name} {arch} {' '.join(options)}:\n{text[-3000:]}"
        return text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_kernels_compile(arch):
    names = ([f"deq_f16<{s}>" for s in STRUCTS] + [f"deq_rows<{s}>" for s in STRUCTS]
             + [f"mv<{s},{r},4>" for s in STRUCTS for r in (1, 2)]
             # the integer matvecs: mvk4k (Q4_K), mvkt's type policies, mvs
             + [f"mvk4k<{n},2,2,{v}>" for n in (1, 2) for v in (1, 3)]
             + [f"mvkt<{t},{n},{r},2,1>" for t in ("MQ4_0", "MQ6_K") for n in (1, 2) for r in (1, 2)]
             + [f"mvs<{t},{n},2>" for t in INT8_STRUCTS for n in (1, 2)]
             # the float-weight matvec
             + [f"mvf<{t},{n},{r}>" for t in ("TF16", "TBF16", "TF32") for n, r in ((1, 2), (1, 4), (8, 1))]
             + [f"q8_act<{bs},{p}>" for bs in (32, 256) for p in range(4)]
             # a mixture of experts at decode (qmoe.cuh): routing, the matvecs by expert id
             + [f"moe_route_q8<{bs}>" for bs in (32, 256)]
             + [f"mvk4k_id<{r},2,{v}>" for r in (1, 2) for v in (1, 3)]
             + [f"mvkt_id<{t},{r},2,1>" for t in ("MQ4_0", "MQ6_K") for r in (1, 2)]
             + [f"mvs_id<{t},{r}>" for t in INT8_STRUCTS for r in (2, 4)])
    # deq_f16's block size comes from the backend (quant.cuda.DEQ_THREADS, whose module
    # needs CuPy): checked here at its value
    _compile(QUANT_CUDA / "qkernels.cu", arch, options=("-DDEQ_THREADS=256",), names=names)


# (head dim, query heads per kv head) of the models Llamba runs: SmolLM2, Qwen2.5-0.5B,
# Qwen2.5-1.5B, Llama 3 8B, Gemma 3 270M, and a multi-head-attention model
@pytest.mark.parametrize("hd,g", [(64, 3), (64, 7), (128, 6), (128, 4), (256, 4), (64, 1)])
@pytest.mark.parametrize("arch", ARCHS)
def test_step_kernels_compile(arch, hd, g):
    from runtime.backend.cuda import _prefill_pq
    _compile(BACKEND / "cuda_kernels.cu", arch,
             options=(f"-DATT_HD={hd}", f"-DATT_G={g}", f"-DPRE_PQ={_prefill_pq(hd, g)}"))


# the k16v8 cache's attention kernels (V in q8_0: ATT_V8) at head dims 64, 128 and 256
@pytest.mark.parametrize("hd,g", [(64, 3), (128, 6), (256, 4)])
@pytest.mark.parametrize("arch", ARCHS)
def test_step_kernels_compile_v8(arch, hd, g):
    from runtime.backend.cuda import _prefill_pq
    _compile(BACKEND / "cuda_kernels.cu", arch,
             options=(f"-DATT_HD={hd}", f"-DATT_G={g}", f"-DPRE_PQ={_prefill_pq(hd, g)}", "-DATT_V8=1"))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_stream_probe_compiles(tmp_path, arch):
    """tests/lab/gpu_stream.py keeps its kernels in a Python string: checked here, for
    the Ampere it needs (cp.async) and the Hopper its bulk copies need, since no CPU test
    runs them."""
    from lab.gpu_stream import _SRC, CONFIGS, kernel_names
    src = tmp_path / "stream_probe.cu"
    src.write_text(_SRC)
    _compile(src, arch, names=kernel_names(CONFIGS))


def test_q8_stream_compiles(tmp_path):
    """runtime/bench_gpu_q8ring.py's kernel (bulk copies: sm_90 and later)."""
    from lab.gpu_q8ring import VARIANTS, _source
    src = tmp_path / "q8_ring.cu"
    src.write_text(_source())
    _compile(src, "compute_90", names=[v[0] for v in VARIANTS])


# the decode megakernel at Llama 3 8B's sizes: the cp.async ring a warp (Q4_K_M's types,
# and Q8_0 beside Q4_K; sm_75 and up) and the bulk-copy ring a block (Q8_0, sm_90 and up)
_MEGA_L8 = ("-default-device", "-DMG_KMAX=14336", "-DMG_NPH=129", "-DMG_HD=128", "-DMG_G=4", "-DMG_WARPS=16")


@pytest.mark.parametrize("arch,options", [
    ("compute_75", ("-DMG_T12=1", "-DMG_T14=1", "-DMG_S=4", "-DMG_SUB=2", "-DMG_RW=75")),
    ("compute_75", ("-DMG_T8=1", "-DMG_T12=1", "-DMG_S=4", "-DMG_SUB=2", "-DMG_RW=138")),   # Q8_0 in chunk order
    ("compute_90", ("-DMG_T8=1", "-DMG_BULK=1", "-DMG_SB=32768", "-DMG_S=4")),
])
def test_megakernel_compiles(arch, options):
    _compile(ROOT / "tests" / "lab" / "mega.cu", arch, options=_MEGA_L8 + options)
