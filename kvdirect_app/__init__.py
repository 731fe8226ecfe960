"""KV-Direct Studio.

Process-wide settings that must be in place before torch loads its math
libraries, so every entry point (CLI, app, tests) gets them by importing this
package first:

* ``MKL_DYNAMIC=FALSE`` and ``OMP_DYNAMIC=FALSE``: the math libraries may
  not change how many threads a call uses on their own.  Results of some
  kernels depend on the thread count (a one-query attention splits its keys
  across threads), so a bit-exact replay needs the same count every time;
  the engine pins it for every forward (`threads.pinned`).
* Quiet profiler logs: the allocation tracer (`memory.py`) starts and stops
  the profiler for every traced block, and Kineto would print a line each
  time.

A variable the user has set is left as it is.
"""

import os

for _name, _value in (("MKL_DYNAMIC", "FALSE"), ("OMP_DYNAMIC", "FALSE"), ("KINETO_LOG_LEVEL", "6"),
                      ("TORCH_CPP_LOG_LEVEL", "ERROR")):
    os.environ.setdefault(_name, _value)
