"""Kernels: the batch-invariant path (`invariant`), the fixed-order linears and attention in C++ (`dots`, with
`dots.cpp`), the probes that prove a vendor GEMM invariant (`probes`), row replay (`replay`, `rows`) and the
native build both C++ libraries share (`native`)."""
