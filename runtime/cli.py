"""`python -m runtime`: generate, chat, serve, tokenize, perplexity, bench, info."""
from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _add_model(p, positional=False):
    if positional:
        p.add_argument("model", nargs="?", default=None, help="a .gguf file, a checkpoint folder or a catalog name")
    else:
        p.add_argument("-m", "--model", default=None,
                       help="a .gguf file, a checkpoint folder or a catalog name (default smollm2-135m)")


def _layers(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {n})")
    return n


def _add_cpu_moe(p):
    """llama.cpp's --cpu-moe / --n-cpu-moe N, into args.n_cpu_moe (-1: every layer)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-cmoe", "--cpu-moe", dest="n_cpu_moe", action="store_const", const=-1, default=0,
                   help="with --device cuda/auto: keep a mixture of experts' expert weights in system memory "
                        "and run them on the CPU (-t threads); the rest on the GPU")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=_layers, metavar="N",
                   help="as --cpu-moe for the experts of the first N layers only")


def _add_engine(p):
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("-ngl", "--gpu-layers", type=int, default=None,
                   help="with --device cuda/auto: only the first N layers on the GPU, the rest on the CPU")
    _add_cpu_moe(p)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context length (default min(4096, model's))")
    p.add_argument("--quant", default="none", choices=["none", "int8", "int4"],
                   help="checkpoint folders: quantize on load (int8: Q8_0; int4: Q4_K_M-style mix)")
    p.add_argument("--cache-type", default="f16", choices=["f16", "q8_0", "k16v8"],
                   help="KV cache precision: f16, q8_0 (about half the memory), or k16v8 (K f16, V q8_0: 77%%)")
    p.add_argument("--overflow", default="stop", choices=["stop", "drop-turns", "shift"],
                   help="when the context is full: stop with a message (default); drop the oldest chat turns "
                        "(keeps the system prompt); or shift out the oldest tokens, re-rotating cached keys")


def _add_sampling(p):
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_constraint(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                   help="constrain the output to JSON valid under this schema (a file or the JSON text)")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="constrain the output to a grammar: .gbnf (llama.cpp) or .lark (llguidance's Lark)")
    g.add_argument("--regex", default=None, metavar="R", help="constrain the output to match this regex")


def _add_draft(p):
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="speculative decoding: a small model sharing the target's vocabulary drafts tokens")
    p.add_argument("--draft-n", type=int, default=8, metavar="K",
                   help="most tokens drafted per round; k adapts below it to the acceptance (default 8)")
    p.add_argument("--draft-fixed", action="store_true", help="always draft exactly --draft-n tokens")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft only among the first N token ids (cheaper draft output layer; 0: all)")
    p.add_argument("--draft-quant", default=None, metavar="TYPE",
                   help="re-encode the draft's layer matrices as TYPE where theirs is larger "
                        "(default q4_0; none: as in the file)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llamba-cli", description="Llamba: local LLM inference")
    ap.add_argument("--version", action="version", version=f"llamba {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="continue a raw prompt")
    _add_model(g); _add_engine(g); _add_sampling(g); _add_draft(g); _add_constraint(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=128)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--json", action="store_true")

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_model(c); _add_engine(c); _add_sampling(c); _add_draft(c); _add_constraint(c)
    c.add_argument("--system", default=None)
    c.add_argument("-n", "--n-predict", type=int, default=1024)

    t = sub.add_parser("tokenize", help="print token ids as JSON")
    _add_model(t)
    t.add_argument("text", nargs="?")
    t.add_argument("--jsonl", default=None, help="file with one JSON string per line")
    t.add_argument("--no-bos", action="store_true")

    pp = sub.add_parser("perplexity", help="llama.cpp-style perplexity of a text file")
    _add_model(pp); _add_engine(pp)
    pp.add_argument("-f", "--file", required=True)
    pp.add_argument("--chunks", type=int, default=0)
    pp.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="llama-bench-style speed test")
    _add_model(b); _add_engine(b); _add_draft(b)
    b.add_argument("-p", "--n-prompt", type=int, default=512)
    b.add_argument("-n", "--n-gen", type=int, default=128)
    b.add_argument("-r", "--repetitions", type=int, default=3)
    b.add_argument("--json", action="store_true")
    b.add_argument("--ctx-depths", default=None, metavar="D1,D2,..",
                   help="also measure tg at these context depths (tokens already in the KV cache)")
    b.add_argument("--plot", default=None, metavar="FILE.png", help="plot tokens/s against context depth")
    b.add_argument("--prefix-reuse", type=int, default=0, metavar="N",
                   help="time to first token of a new turn after an N-token history, cold vs reused")
    b.add_argument("--peer", default=None, help="python of a venv with llama-cpp-python: bench it side by side")
    b.add_argument("--draft-sweep", default="2,3,4,6", metavar="K,K,...",
                   help="with --draft-model: fixed draft lengths to compare besides adaptive k")
    b.add_argument("--spec-prompt", action="append", default=None, metavar="TEXT",
                   help="with --draft-model: a prompt to decode from (repeatable; default: code prompts)")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server that many clients share")
    _add_model(s)
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    s.add_argument("-ngl", "--gpu-layers", type=int, default=None)
    _add_cpu_moe(s)
    s.add_argument("-t", "--threads", type=int, default=None)
    s.add_argument("-c", "--ctx-size", type=int, default=4096, help="a request's context: prompt + answer (default 4096)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8080, help="port (0: any free one; the URL is printed)")
    s.add_argument("-np", "--parallel", type=int, default=8, help="requests computed at once (default 8)")
    s.add_argument("--queue", type=int, default=64, help="requests that may wait beyond those (default 64; 503 past it)")
    s.add_argument("--kv-tokens", type=int, default=0,
                   help="KV-cache pool in tokens, shared by all requests (default: parallel x ctx, at most 2 GiB)")
    s.add_argument("--cache-type", default="f16", choices=["f16", "q8_0", "k16v8"])
    s.add_argument("--cache-ram", type=int, default=None, metavar="MiB",
                   help="KV memory that finished requests' blocks may keep for prefix reuse (default on the CPU: "
                        "8192 as llama-server, or the whole pool where smaller; -1: the whole pool)")
    s.add_argument("--no-prefix-cache", action="store_true", help="never reuse KV blocks across requests")
    s.add_argument("--reasoning-format", default="auto", choices=["auto", "deepseek", "none"],
                   help="a model's reasoning (Qwen3's <think>, gpt-oss's analysis) in message.reasoning_content "
                        "(auto, deepseek: llama-server's names) or left in content (none); a request's "
                        "reasoning_format overrides it")
    s.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="speculative decoding while a request decodes alone (a small model of the same vocabulary)")
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    key.add_argument("--api-key-file", default=None, help="read the API key from this file")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser pages from ORIGIN (repeatable; default: none)")
    s.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    s.add_argument("--max-body", type=int, default=8 << 20, help="largest request body in bytes (default 8 MiB)")

    bs = sub.add_parser("bench-serve", help="load an OpenAI-compatible server with concurrent streaming clients")
    from .bench.serve import add_arguments
    add_arguments(bs)

    i = sub.add_parser("info", help="architecture, parameters, tensor types, KV bytes per token")
    _add_model(i, positional=True)
    i.add_argument("-c", "--ctx-size", type=int, default=0, help="the context the memory estimate is for "
                   "(default min(4096, model's))")
    i.add_argument("--cache-type", default="f16", choices=["f16", "q8_0", "k16v8"],
                   help="the KV cache precision the KV bytes and the memory estimate are for")
    i.add_argument("-ngl", "--gpu-layers", type=int, default=None,
                   help="the memory estimate for the first N layers on the GPU (the rest on the CPU)")
    _add_cpu_moe(i)
    i.add_argument("--json", action="store_true")
    return ap


def _say(msg: str) -> None:
    """Progress and notices go to stderr: stdout is the answer (or --json)."""
    print(msg, file=sys.stderr)


def _engine(args):
    from .engine import Engine
    model = args.model
    if getattr(args, "quant", "none") != "none":
        from .loader import load_model
        model = load_model(args.model, quant=args.quant)
    from .warmup import warm_up
    engine = Engine(model, device=args.device, n_ctx=args.ctx_size, threads=args.threads,
                    gpu_layers=getattr(args, "gpu_layers", None), cpu_moe=getattr(args, "n_cpu_moe", 0),
                    cache_type=args.cache_type, overflow="shift" if args.overflow == "shift" else "stop",
                    announce=_say)
    warm_up(engine, notice=_say)
    return engine


def _drafter(args, eng):
    if not getattr(args, "draft_model", None):
        return None
    from .speculative import DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, Drafter
    vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    dq = DEFAULT_DRAFT_QUANT if args.draft_quant is None else args.draft_quant
    from .warmup import warm_up
    d = Drafter.load(args.draft_model, eng, k=args.draft_n, adaptive=not args.draft_fixed,
                     draft_vocab=vocab, draft_quant=dq, announce=_say)
    warm_up(d.draft, notice=_say)
    return d


def _constraint(args, eng):
    """The --json-schema / --grammar / --regex constraint (None without one); ConstraintError is a ValueError."""
    from pathlib import Path
    if not (args.json_schema or args.grammar or args.regex):
        return None
    from .constrain import Constraint
    if args.regex:
        return Constraint.regex(args.regex, eng)
    if args.grammar:
        path = Path(args.grammar)
        text = path.read_text(encoding="utf-8")
        ext = path.suffix.lower()
        if ext == ".gbnf":
            return Constraint.gbnf(text, eng)
        if ext == ".lark":
            return Constraint.lark(text, eng)
        return Constraint.grammar(text, eng)       # by content: `::=` rules are GBNF
    src = args.json_schema
    text = src if src.lstrip().startswith(("{", "true")) else Path(src).read_text(encoding="utf-8")
    return Constraint.json_schema(text, eng)


def _params(args):
    from .sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, seed=args.seed)


def cmd_generate(args) -> int:
    from .generate import Generation
    eng = _engine(args)
    ids = eng.tokenizer.encode(args.prompt)
    gen = Generation(eng, ids, _params(args), max_tokens=args.n_predict, stop=tuple(args.stop),
                     drafter=_drafter(args, eng), constraint=_constraint(args, eng))
    if args.json:
        gen.run()
        st = gen.stats
        out = {"ids": gen.ids, "text": gen.text, "prompt_tokens": st.prompt_tokens,
               "prompt_tokens_per_s": round(st.prompt_tokens_per_s, 2),
               "tokens_per_s": round(st.tokens_per_s, 2), "stop_reason": st.stop_reason,
               "kv_cache": eng.stats()}
        if st.speculative:
            out["speculative"] = st.speculative
        if st.constraint_error:
            out["constraint_error"] = st.constraint_error
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write(args.prompt)
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        st = gen.stats
        print(f"\n\n[{st.prompt_tokens} prompt tokens at {st.prompt_tokens_per_s:.1f} t/s, "
              f"{st.generated_tokens} generated at {st.tokens_per_s:.1f} t/s, stop: {st.stop_reason}]",
              file=sys.stderr)
        if st.speculative:
            print(_spec_line(st.speculative), file=sys.stderr)
    return 0


def _spec_line(sp: dict) -> str:
    return (f"[draft: {sp['accepted']}/{sp['drafted']} accepted ({sp['acceptance_rate']:.0%}), "
            f"{sp['tokens_per_target_forward']:.2f} tokens per target step, speedup {sp['speedup']:.2f}x, "
            f"speculation {sp['speculation']}]")


def cmd_chat(args) -> int:
    from . import reasoning
    from .chat import ChatSession
    eng = _engine(args)
    chat = ChatSession(eng, system=args.system, params=_params(args), max_tokens=args.n_predict,
                       overflow=args.overflow, constraint=_constraint(args, eng),
                       drafter=_drafter(args, eng))
    print("Chatting with", eng.loaded.path.name, "— empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not user.strip():
            return 0
        # the model's reasoning (think tags, gpt-oss's analysis channel) to stderr, dimmed on a
        # terminal; its answer to stdout
        deltas, dim = reasoning.Deltas(), sys.stderr.isatty()
        thought = False
        for piece in [*chat.send(user), None]:
            r, a = deltas.feed(piece) if piece is not None else deltas.finish()
            if r:
                sys.stderr.write(f"\x1b[2m{r}\x1b[0m" if dim else r)
                sys.stderr.flush()
                thought = True
            if a:
                if thought:
                    sys.stderr.write("\n\n")
                    thought = False
                sys.stdout.write(a)
                sys.stdout.flush()
        st = chat.last_stats
        print(f"\n[{st.generated_tokens} tokens, {st.tokens_per_s:.1f} t/s]", file=sys.stderr)
        if st.speculative:
            print(_spec_line(st.speculative), file=sys.stderr)


def cmd_tokenize(args) -> int:
    from .loader import load_model
    tok = load_model(args.model).tokenizer
    add_bos = False if args.no_bos else None
    if args.jsonl:
        with open(args.jsonl, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    print(json.dumps(tok.encode(json.loads(line), add_bos=add_bos)))
    else:
        if args.text is None:
            raise SystemExit("tokenize: give TEXT or --jsonl FILE")
        print(json.dumps(tok.encode(args.text, add_bos=add_bos)))
    return 0


def cmd_perplexity(args) -> int:
    from .bench.perplexity import perplexity
    eng = _engine(args)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    res = perplexity(eng, text, n_ctx=args.ctx_size or 512, max_chunks=args.chunks,
                     progress=None if args.json else lambda i, n, p: print(f"[{i}/{n}] {p:.4f}", file=sys.stderr))
    if args.json:
        print(json.dumps(res))
    else:
        print(f"PPL = {res['ppl']:.4f} +/- {res['stderr']:.4f}")
    return 0


def cmd_bench(args) -> int:
    if args.draft_model:
        from .bench.speculative import run_spec_bench
        return run_spec_bench(args)
    from .bench.speed import run_bench
    return run_bench(args)


def cmd_serve(args) -> int:
    from .server import ServeConfig, serve
    key = args.api_key
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"{args.api_key_file} holds no API key")
    for name in ("ctx_size", "parallel", "queue", "port", "max_body"):
        if getattr(args, name) < (0 if name in ("port", "queue") else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    from .backend import check_cpu_moe
    check_cpu_moe(args.device, args.n_cpu_moe)      # now, not once the server is up and loading
    cfg = ServeConfig(model=args.model, device=args.device, threads=args.threads, n_ctx=args.ctx_size,
                      parallel=args.parallel, queue=args.queue, kv_tokens=args.kv_tokens, cache_type=args.cache_type,
                      prefix_cache=not args.no_prefix_cache, gpu_layers=args.gpu_layers, draft_model=args.draft_model,
                      cache_ram=args.cache_ram, cpu_moe=args.n_cpu_moe, reasoning_format=args.reasoning_format)
    return serve(cfg, host=args.host, port=args.port, api_key=key, cors_origins=args.cors_origin,
                 metrics=args.metrics, max_body=args.max_body, say=_say)


def cmd_bench_serve(args) -> int:
    from .bench.serve import run
    return run(args)


def cmd_info(args) -> int:
    from .loader import load_model
    from quant import type_name
    lm = load_model(args.model)
    cfg = lm.config
    types = {}
    for t in lm.tensors.values():
        types[type_name(t.qtype)] = types.get(type_name(t.qtype), 0) + 1
    from .kv_cache import kv_bytes_per_token_layer
    kv_per_token = cfg.n_layers * kv_bytes_per_token_layer(cfg.n_kv_heads, cfg.head_dim, args.cache_type)
    info = {"path": str(lm.path), "name": cfg.name, "architecture": cfg.arch, "parameters": lm.n_params,
            "weight_bytes": lm.weight_bytes, "tensor_types": types, "context_length": cfg.context_length,
            "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "kv_cache_type": args.cache_type,
            "kv_bytes_per_token": kv_per_token}
    if cfg.n_experts:   # mixture of experts: what a token reads, beside what the file holds
        info["active_parameters"] = lm.n_active_params
        info["experts"] = {"count": cfg.n_experts, "used": cfg.n_experts_used, "d_ff_expert": cfg.d_ff_expert,
                           "normalized_top_k": cfg.expert_norm_topk}
    from .backend.cuda_memory import estimate_bytes   # before loading: what a GPU would need
    n_ctx = min(args.ctx_size or 4096, cfg.context_length)
    if cfg.for_context(n_ctx).rope_scaling():    # (LongRoPE: the factors this context takes)
        info["rope_scaling"] = cfg.for_context(n_ctx).rope_scaling()
    # (with -ngl / --cpu-moe / --n-cpu-moe: the GPU's share; host_weights: what stays in system memory)
    placed = {"gpu_layers": args.gpu_layers} if args.gpu_layers is not None else {}
    if args.n_cpu_moe and cfg.n_experts:      # layers whose experts stay on the host
        placed["cpu_moe_layers"] = cfg.n_layers if args.n_cpu_moe < 0 else min(args.n_cpu_moe, cfg.n_layers)
    info["gpu_memory_estimate"] = {"n_ctx": n_ctx, **placed, **estimate_bytes(
        cfg, lm.tensors, n_ctx, cache_type=args.cache_type, gpu_layers=args.gpu_layers, cpu_moe=args.n_cpu_moe)}
    if args.n_cpu_moe and not cfg.n_experts:
        _say(f"--cpu-moe / --n-cpu-moe: {lm.path.name} has no experts; the flag has no effect")
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:>20}: {v}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    handler = globals()["cmd_" + args.cmd.replace("-", "_")]
    try:
        return handler(args) or 0
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, RuntimeError, KeyError, OSError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 1
