"""Headless benchmark CLI (the commands live in `kvdirect_app.cli`).

    python -m kvdirect_app.bench run --model smollm2-135m \\
        --strategies full,kvdirect:budget=64:mode=exact,kvdirect:budget=64:mode=fast \\
        --max-new-tokens 64 --json out.json

Prints tables and writes JSON.  Bad input exits with status 2 and one line.
"""

import sys

from .cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
