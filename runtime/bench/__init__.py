"""Benchmarks users run, behind the CLI: `bench` (speed.py, llama-bench-style pp/tg, with
llama.cpp side by side through peer.py), `bench --draft-model` (speculative.py), `perplexity`,
`bench-serve` (serve.py: any OpenAI-compatible server under concurrent clients) and the
constrained-decoding cost (constrain.py).  Probes and experiments live in tests/lab/."""
