"""KV-Direct Studio entry point (`make demo`).

Until the web UI lands, this runs a short side-by-side comparison on the
embedded default model and prints the table.
"""

import sys

from kvdirect_app.bench import main

DEMO = ["run", "--model", "smollm2-135m",
        "--strategies", "full,kvdirect:budget=64:mode=exact,kvdirect:budget=64:mode=fast",
        "--prompt", "Explain in a few sentences why the sky is blue.", "--max-new-tokens", "48"]

if __name__ == "__main__":
    sys.exit(main(DEMO + sys.argv[1:]))
