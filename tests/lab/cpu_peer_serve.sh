#!/bin/bash
# Our server beside llama.cpp's llama-server on the CPU, same GGUF, same threads, both up, taking
# turns: a warm-up request set on ours, then ROUNDS rounds of `bench-serve -C 1,8` against each.
#   LLAMA_SERVER=/path/to/llama-server [MODEL=file.gguf] [ROUNDS=3] [NP=8] tests/lab/cpu_peer_serve.sh
# (llama.cpp built with AMX off on these Xeons: see quant/NOTES.md.)  Output: $OUT/rR-PORT.json
# and one line a round: tokens/s at 1 and 8 clients, the ratios, time to first token and
# inter-token latency at 8 clients.
set -o pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-$(python3 -c "from runtime.download import fetch; print(fetch('qwen2.5-coder-0.5b'))")}
OUT=${OUT:-/tmp/llamba-cpu-peer}; mkdir -p "$OUT"
NP=${NP:-8}; T=${THREADS:-2}
python3 -m runtime serve -m "$MODEL" -t "$T" -np "$NP" -c 4096 --port 8191 >"$OUT/ours.log" 2>&1 &
OURS=$!
"$LLAMA_SERVER" -m "$MODEL" -t "$T" -np "$NP" -c $((4096 * NP)) --port 8192 >"$OUT/peer.log" 2>&1 &
PEER=$!
trap 'kill $OURS $PEER 2>/dev/null' EXIT
for p in 8191 8192; do
  for _ in $(seq 300); do curl -fs http://127.0.0.1:$p/health >/dev/null 2>&1 && break; sleep 1; done
done
python3 -m runtime bench-serve http://127.0.0.1:8191 -C 1,8 --requests 1 -n 16 >"$OUT/warm.txt" 2>&1
for r in $(seq "${ROUNDS:-3}"); do
  for p in 8191 8192; do
    python3 -m runtime bench-serve http://127.0.0.1:$p -C 1,$NP --requests 3 -n 64 --json >"$OUT/r$r-$p.json" \
      2>"$OUT/r$r-$p.err"
  done
  python3 - "$OUT" "$r" "$NP" <<'PY'
import json, sys
out, r, np_ = sys.argv[1], sys.argv[2], int(sys.argv[3])
row = {(p, x["concurrency"]): x for p in (8191, 8192) for x in json.load(open(f"{out}/r{r}-{p}.json"))["rows"]}
o1, on, p1, pn = row[(8191, 1)], row[(8191, np_)], row[(8192, 1)], row[(8192, np_)]
t = lambda x: x["output_tok_s"]
print(f"round {r}: ours {t(o1):.1f} / {t(on):.1f} tok/s at 1 / {np_} clients ({t(on) / t(o1):.2f}x), llama-server "
      f"{t(p1):.1f} / {t(pn):.1f} (ours over it at {np_}: {t(on) / t(pn):.2f}x); at {np_} clients TTFT p50/p99 "
      f"ours {on['ttft_p50_ms']:.0f}/{on['ttft_p99_ms']:.0f} ms, llama-server {pn['ttft_p50_ms']:.0f}/"
      f"{pn['ttft_p99_ms']:.0f}; ITL p50/p99 ours {on['itl_p50_ms']:.0f}/{on['itl_p99_ms']:.0f}, llama-server "
      f"{pn['itl_p50_ms']:.0f}/{pn['itl_p99_ms']:.0f}")
PY
done
