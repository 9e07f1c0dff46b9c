#!/usr/bin/env python3
"""llama.cpp peer benchmark: the llama.cpp side of Llamba's side-by-side benchmark.

This script measures llama.cpp itself (through the llama-cpp-python bindings)
the way ``llama-bench`` does, so that Llamba's own numbers can be put next to
the reference engine's on the same machine, model file and thread count.

It is deliberately standalone: it imports only the standard library,
``llama_cpp`` and ``numpy`` -- never anything from this project -- because it
runs under a separate interpreter (a virtualenv that has llama-cpp-python
built from source, e.g. ``/work/peer-venv/bin/python``). It is launched either
by ``python -m runtime bench --peer /path/to/python`` (which runs this file
under that interpreter with ``--json`` and merges the rows), or by hand::

    /work/peer-venv/bin/python runtime/bench/peer.py -m MODEL.gguf \\
        [-p 512] [-n 128] [-r 3] [-t 2] [--fa] [--ctx-depth D] [--json]

What is measured (mirroring llama-bench's ``test_prompt`` / ``test_gen``):

* ``ppP`` -- prompt processing: a P-token prompt of random token ids (the
  first one BOS when the vocabulary adds one) is decoded in chunks of
  ``n_batch`` starting from an empty KV cache (cleared before every rep);
  t/s = P / time.
* ``tgN`` -- text generation: N single-token decodes, one at a time, each
  followed by a synchronize; the next token is a random id, so no sampling or
  logits post-processing is counted; t/s = N / time.
* ``--ctx-depth D`` puts D random tokens in the KV cache before each timed run
  (untimed, computed once and then restored from a saved sequence state, as
  llama-bench does); the table shows ``tg128 @ dD``.

Each test gets one untimed warm-up run, then ``-r`` timed reps; the reported
figure is the mean of the per-rep t/s and its sample standard deviation
(exactly llama-bench's ``avg_ts`` / ``stdev_ts``).

Decoding goes through llama-cpp-python's low-level C API (``llama_decode`` on
``llama_batch_get_one``) on the context of a ``llama_cpp.Llama`` object; if a
binding lacks those symbols the script falls back to ``Llama.eval()`` /
``Llama.reset()``.

Threads: the wheel is built with OpenMP (as llama-bench is by default), whose
threads spin while waiting. On a machine whose cores are oversubscribed by
other processes that collapses multi-threaded throughput (tg with -t 2 can
drop 10x below -t 1); ``--omp-wait-policy passive`` sets ``OMP_WAIT_POLICY``
before llama.cpp loads and avoids it. The policy used is in each JSON row.

Output: a llama-bench style markdown table, or with ``--json`` a JSON list of
rows with keys ``test`` ("pp512", "tg128"), ``t_s``, ``sd``, ``backend``
("llama.cpp (llama-cpp-python X.Y.Z)"), ``threads``, ``model`` (file name),
``depth`` plus some extra detail keys (samples, model size, flash_attn, ...).
Progress messages go to stderr, so stdout holds only the table or the JSON.
"""

import argparse
import ctypes
import json
import math
import os
import random
import statistics
import sys
import time

llama_cpp = None  # imported in _load_llama_cpp(), after OMP_* may have been set


def _load_llama_cpp():
    global llama_cpp
    try:
        import llama_cpp as mod
    except ImportError as exc:  # depends on the interpreter
        sys.stderr.write(
            "bench_peer.py: cannot import llama_cpp (%s).\n"
            "Run it with the interpreter of a venv that has llama-cpp-python, "
            "e.g. /work/peer-venv/bin/python.\n" % exc)
        sys.exit(2)
    llama_cpp = mod


def _int_list(text):
    """Parse '512' or '128,256' (llama-bench accepts comma lists too)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part:
            value = int(part)
            if value < 0:
                raise argparse.ArgumentTypeError("must be >= 0: %r" % text)
            out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("empty list: %r" % text)
    return out


def _log(args, msg):
    if args.progress:
        sys.stderr.write("bench_peer: %s\n" % msg)
        sys.stderr.flush()


class Runner:
    """Owns one llama_cpp.Llama and runs llama-bench style tests on it."""

    def __init__(self, args, n_ctx):
        self.args = args
        self.llm = llama_cpp.Llama(
            model_path=args.model,
            n_ctx=n_ctx,
            n_batch=args.batch,
            n_ubatch=args.ubatch,
            n_threads=args.threads[0],
            n_threads_batch=args.threads[0],
            flash_attn=args.fa,
            logits_all=False,
            use_mmap=not args.no_mmap,
            verbose=args.verbose,
        )
        self.rng = random.Random(args.seed)
        self.low_level = (not args.use_eval) and all(
            hasattr(llama_cpp, name) for name in (
                "llama_batch_get_one", "llama_decode", "llama_synchronize",
                "llama_get_memory", "llama_memory_clear", "llama_set_n_threads"))
        self.ctx = self.llm.ctx if self.low_level else None
        self.n_vocab = self.llm.n_vocab()
        self.add_bos = False
        self.bos = -1
        try:
            vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
            self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
            self.bos = int(llama_cpp.llama_vocab_bos(vocab))
        except Exception:  # older bindings: fall back to the high-level view
            try:
                self.bos = int(self.llm.token_bos())
                self.add_bos = self.bos >= 0 and bool(
                    self.llm.metadata.get("tokenizer.ggml.add_bos_token", "false")
                    == "true")
            except Exception:
                pass
        self.depth_state = {}  # depth -> saved sequence-0 state (bytes buffer)
        self.n_past = 0

    # -- model description (for the table) ---------------------------------
    def model_info(self):
        info = {"desc": None, "size": None, "n_params": None}
        try:
            buf = ctypes.create_string_buffer(256)
            llama_cpp.llama_model_desc(self.llm.model, buf, ctypes.sizeof(buf))
            info["desc"] = buf.value.decode("utf-8", "replace")
        except Exception:
            pass
        for key, fn in (("size", "llama_model_size"), ("n_params", "llama_model_n_params")):
            try:
                info[key] = int(getattr(llama_cpp, fn)(self.llm.model))
            except Exception:
                pass
        return info

    # -- primitives ----------------------------------------------------------
    def set_threads(self, n):
        if hasattr(llama_cpp, "llama_set_n_threads"):
            llama_cpp.llama_set_n_threads(self.llm.ctx, n, n)

    def clear(self):
        if self.low_level:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), False)
        else:
            self.llm.reset()
        self.n_past = 0

    def _decode(self, tokens):
        if self.low_level:
            arr = (llama_cpp.llama_token * len(tokens))(*tokens)
            batch = llama_cpp.llama_batch_get_one(arr, len(tokens))
            rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError("llama_decode returned %d" % rc)
        else:
            self.llm.eval(tokens)
        self.n_past += len(tokens)

    def _sync(self):
        if self.low_level:
            llama_cpp.llama_synchronize(self.ctx)

    def _rand_token(self):
        return self.rng.randrange(self.n_vocab)

    def prompt(self, n_prompt):
        """llama-bench test_prompt: n_prompt random tokens in n_batch chunks."""
        n_batch = self.args.batch
        done = 0
        while done < n_prompt:
            n = min(n_prompt - done, n_batch)
            tokens = [self._rand_token() for _ in range(n)]
            if done == 0 and self.add_bos and self.bos >= 0:
                tokens[0] = self.bos
            self._decode(tokens)
            done += n
        self._sync()

    def gen(self, n_gen):
        """llama-bench test_gen: n_gen single-token decodes."""
        token = self.bos if (self.add_bos and self.bos >= 0) else self._rand_token()
        for _ in range(n_gen):
            self._decode([token])
            self._sync()
            token = self._rand_token()

    def fill_depth(self, depth):
        """Put `depth` tokens in the cache (untimed), reusing a saved state."""
        if depth <= 0:
            return
        saved = self.depth_state.get(depth)
        if saved is not None and self.low_level:
            try:
                ret = llama_cpp.llama_state_seq_set_data(
                    self.ctx, saved, len(saved), 0)
                if ret:
                    self.n_past = depth
                    return
            except Exception:
                pass
            self.clear()
        self.prompt(depth)
        if self.low_level and hasattr(llama_cpp, "llama_state_seq_get_size"):
            try:
                size = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
                buf = (ctypes.c_uint8 * size)()
                got = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, 0)
                if got:
                    self.depth_state[depth] = buf
            except Exception:
                pass

    # -- one llama-bench test --------------------------------------------------
    def run_test(self, kind, n, depth, threads):
        args = self.args
        self.set_threads(threads)
        name = "%s%d" % (kind, n)

        def once():
            self.clear()
            self.fill_depth(depth)
            t0 = time.perf_counter_ns()
            if kind == "pp":
                self.prompt(n)
            else:
                self.gen(n)
            return time.perf_counter_ns() - t0

        if not args.no_warmup:
            _log(args, "%s @ d%d t=%d: warm-up" % (name, depth, threads))
            once()
        samples_ns = []
        for i in range(args.reps):
            ns = once()
            samples_ns.append(ns)
            _log(args, "%s @ d%d t=%d: rep %d/%d %.2f t/s" % (
                name, depth, threads, i + 1, args.reps, n * 1e9 / ns))
        samples_ts = [n * 1e9 / ns for ns in samples_ns]
        mean = statistics.fmean(samples_ts)
        sd = statistics.stdev(samples_ts) if len(samples_ts) > 1 else 0.0
        return {
            "test": name,
            "t_s": mean,
            "sd": sd,
            "depth": depth,
            "threads": threads,
            "n_prompt": n if kind == "pp" else 0,
            "n_gen": n if kind == "tg" else 0,
            "samples_ns": samples_ns,
            "samples_ts": samples_ts,
        }


def _fmt_size(nbytes):
    if nbytes is None:
        return "?"
    if nbytes >= 1024 ** 3:
        return "%.2f GiB" % (nbytes / 1024 ** 3)
    return "%.2f MiB" % (nbytes / 1024 ** 2)


def _fmt_params(n):
    if n is None:
        return "?"
    if n >= 1e9:
        return "%.2f B" % (n / 1e9)
    return "%.2f M" % (n / 1e6)


def print_table(rows, out=sys.stdout):
    cols = [("model", "<"), ("size", ">"), ("params", ">"), ("backend", "<"),
            ("threads", ">"), ("fa", ">"), ("test", ">"), ("t/s", ">")]
    cells = []
    for r in rows:
        test = r["test"] + (" @ d%d" % r["depth"] if r["depth"] else "")
        cells.append({
            "model": r.get("model_type") or r["model"],
            "size": _fmt_size(r.get("model_size")),
            "params": _fmt_params(r.get("model_n_params")),
            "backend": r["backend"],
            "threads": str(r["threads"]),
            "fa": "1" if r.get("flash_attn") else "0",
            "test": test,
            "t/s": "%.2f ± %.2f" % (r["t_s"], r["sd"]),
        })
    widths = {c: max([len(c)] + [len(x[c]) for x in cells]) for c, _ in cols}
    line = "| " + " | ".join(
        c.ljust(widths[c]) if a == "<" else c.rjust(widths[c]) for c, a in cols) + " |"
    sep = "| " + " | ".join(
        "-" * widths[c] if a == "<" else "-" * (widths[c] - 1) + ":" for c, a in cols) + " |"
    out.write(line + "\n" + sep + "\n")
    for x in cells:
        out.write("| " + " | ".join(
            x[c].ljust(widths[c]) if a == "<" else x[c].rjust(widths[c])
            for c, a in cols) + " |\n")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="llama-bench style benchmark of llama.cpp via llama-cpp-python "
                    "(the peer side of Llamba's side-by-side benchmark).")
    ap.add_argument("-m", "--model", required=True, help="path to a GGUF file")
    ap.add_argument("-p", "--n-prompt", type=_int_list, default=[512],
                    help="prompt length(s) for ppN tests, comma list; 0 skips (default 512)")
    ap.add_argument("-n", "--n-gen", type=_int_list, default=[128],
                    help="token count(s) for tgN tests, comma list; 0 skips (default 128)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="timed repetitions (default 3)")
    ap.add_argument("-t", "--threads", type=_int_list, default=[2],
                    help="thread count(s), comma list (default 2)")
    ap.add_argument("-d", "--ctx-depth", type=_int_list, default=[0],
                    help="tokens already in the KV cache before each test, comma list (default 0)")
    ap.add_argument("--fa", action="store_true", help="enable flash attention")
    ap.add_argument("-b", "--batch", type=int, default=512, help="n_batch (default 512)")
    ap.add_argument("-ub", "--ubatch", type=int, default=512, help="n_ubatch (default 512)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the random token ids")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    ap.add_argument("--no-mmap", action="store_true", help="load the model without mmap")
    ap.add_argument("--use-eval", action="store_true",
                    help="decode through Llama.eval()/reset() instead of llama_decode")
    ap.add_argument("--omp-wait-policy", choices=("active", "passive"), default=None,
                    help="set OMP_WAIT_POLICY for llama.cpp's OpenMP threads (default: "
                         "inherit the environment, i.e. OpenMP's active spinning like "
                         "llama-bench). 'passive' is far faster when the cores are "
                         "oversubscribed by other processes")
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows")
    ap.add_argument("--progress", action="store_true", help="progress messages on stderr")
    ap.add_argument("--verbose", action="store_true", help="let llama.cpp log to stderr")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("-r must be >= 1")
    if not os.path.isfile(args.model):
        ap.error("no such model file: %s" % args.model)

    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    _load_llama_cpp()

    n_prompts = [p for p in args.n_prompt if p > 0]
    n_gens = [n for n in args.n_gen if n > 0]
    if not n_prompts and not n_gens:
        ap.error("nothing to run: -p and -n are both 0")
    # One context big enough for every test (llama-bench sizes it per test as
    # depth + prompt + gen; the KV cells actually attended are the used ones).
    n_ctx = max(args.ctx_depth) + max(n_prompts + n_gens)
    n_ctx = max(n_ctx, 64)

    version = getattr(llama_cpp, "__version__", "unknown")
    backend = "llama.cpp (llama-cpp-python %s)" % version
    runner = Runner(args, n_ctx)
    info = runner.model_info()
    try:
        system_info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    except Exception:
        system_info = None
    _log(args, "%s; n_ctx=%d; decode via %s; %s" % (
        backend, n_ctx, "llama_decode" if runner.low_level else "Llama.eval",
        system_info))

    rows = []
    for threads in args.threads:
        for depth in args.ctx_depth:
            for kind, sizes in (("pp", n_prompts), ("tg", n_gens)):
                for n in sizes:
                    row = runner.run_test(kind, n, depth, threads)
                    row.update({
                        "backend": backend,
                        "model": os.path.basename(args.model),
                        "model_path": os.path.abspath(args.model),
                        "model_type": info["desc"],
                        "model_size": info["size"],
                        "model_n_params": info["n_params"],
                        "flash_attn": bool(args.fa),
                        "n_batch": args.batch,
                        "n_ubatch": args.ubatch,
                        "n_ctx": n_ctx,
                        "reps": args.reps,
                        "llama_cpp_python": version,
                        "decode_api": "llama_decode" if runner.low_level else "Llama.eval",
                        "system_info": system_info,
                        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                    })
                    rows.append(row)
                    if not math.isfinite(row["t_s"]):
                        raise RuntimeError("non-finite result for %s" % row["test"])

    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_table(rows)
        sys.stdout.write("\nbuild: %s, n_batch=%d, n_ubatch=%d, reps=%d%s\n" % (
            backend, args.batch, args.ubatch, args.reps,
            "" if runner.low_level else " (Llama.eval path)"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
