"""KV-Direct Studio.

Process-wide settings that must be in place before torch loads its math
libraries, so every entry point (CLI, app, tests) gets them by importing this
package first:

* ``MKL_DYNAMIC=FALSE`` and ``OMP_DYNAMIC=FALSE``: the math libraries may
  not change how many threads a call uses on their own.  Results of some
  kernels depend on the thread count (a one-query attention splits its keys
  across threads), so a bit-exact replay needs the same count every time;
  the engine pins it for every forward (`threads.pinned`).
* ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads sleep instead of spinning
  while they wait.  The app runs the engine on a thread of its own (the
  web server keeps the main one); with the default (spinning) policy, a
  decode step there took 1.34x as long as on the main thread on a 2-core
  machine (three alternating runs each), so the app's ms per token did not
  agree with `bench run`'s.  With PASSIVE both take the same time (ratio
  0.99), in the CLI and in the app alike.
* ``GOMP_SPINCOUNT=300000`` (libgomp's own default where no policy is set): with PASSIVE alone, the worker
  thread slept after every parallel op, and a decode step is hundreds of short ops, each then paying a
  wake-up: SmolLM2's plain full cache took 61 ms a step, 36-40 ms with this (2-core CPU, main thread and a
  fresh thread alike).  libgomp spins only while the process's OpenMP teams hold no more threads than there
  are cores (else PASSIVE's sleep at once holds, the case above), so the app runs all of its torch work on
  one compute thread (`ui.runner.compute`).  These two concern torch's own ops: the fixed-order kernels
  (`kernels/dots.cpp`) run on a team of their own, and in the invariant mode torch's ops run at one thread.
* ``MKL_DISABLE_FAST_MM=1``: MKL's memory manager keeps the buffers of its calls for reuse, per thread and
  call shape, and no one frees them; on an Intel Xeon a prompt's `einsum` (a scorer's attention, the attention
  snapshot) left 4.2 MiB of the C allocator in use at each new prompt length, bytes the memory cross-check
  reports as held by no lane (`measure/ledger.CrossCheck`).  With it, MKL frees them after each call (an AMD
  EPYC, where MKL takes other paths, kept none either way).
* Quiet profiler logs: the allocation tracer (`memory.py`) starts and stops
  the profiler for every traced block, and Kineto would print a line each
  time.

A variable the user has set is left as it is.
"""

import os

__version__ = "0.4.0"  # pyproject.toml's (a test checks they agree)

for _name, _value in (
    ("MKL_DYNAMIC", "FALSE"),
    ("OMP_DYNAMIC", "FALSE"),
    ("OMP_WAIT_POLICY", "PASSIVE"),
    ("GOMP_SPINCOUNT", "300000"),
    ("MKL_DISABLE_FAST_MM", "1"),
    ("KINETO_LOG_LEVEL", "6"),
    ("TORCH_CPP_LOG_LEVEL", "ERROR"),
):
    os.environ.setdefault(_name, _value)

__all__ = ["strategy_cache"]


def __getattr__(name: str):
    """`from kvdirect_app import strategy_cache` imports torch only when asked for it (the recording player and
    the package's settings above need no torch)."""
    if name == "strategy_cache":
        from .engine.integration import strategy_cache  # lazy: the package's settings and the page need no torch

        return strategy_cache
    raise AttributeError(f"module 'kvdirect_app' has no attribute {name!r}")
