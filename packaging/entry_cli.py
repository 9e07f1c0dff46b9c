"""Frozen entry point of `llamba-cli` (= python -m runtime)."""
import sys

from runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
