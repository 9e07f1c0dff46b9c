"""`python -m quant SRC -o OUT.gguf --type f16|q8_0|q4_0|q4_k_m`: convert a
Hugging Face safetensors checkpoint folder to a GGUF file that Llamba and
llama.cpp both load."""
from __future__ import annotations

import argparse
import json
import sys

from .policy import SCHEMES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="checkpoint folder: config.json, *.safetensors, tokenizer.json")
    ap.add_argument("-o", "--output", required=True, help="the .gguf file to write")
    ap.add_argument("--type", default="f16", choices=SCHEMES,
                    help="f16 (default), q8_0, q4_0, q4_k_m (llama.cpp's per-tensor mix) or mxfp4_moe (MoE "
                         "experts MXFP4, the rest Q8_0, as llama.cpp's MXFP4_MOE); also f32, bf16")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from .convert import convert
    try:
        res = convert(args.src, args.output, args.type, progress=False if args.no_progress else None)
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        types = ", ".join(f"{k} {v}" for k, v in sorted(res["tensor_types"].items()))
        print(f"wrote {res['path']}: {res['bytes'] / 1e6:.1f} MB in {res['seconds']:.1f} s "
              f"({res['mb_per_s']:.1f} MB/s); tensors: {types}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
