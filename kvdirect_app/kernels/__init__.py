"""Kernels: the batch-invariant path (`invariant`), the fixed-order linears and attention in C++ (`dots`, with
`dots.cpp`), the probes that prove a vendor GEMM invariant (`probes`), exact K/V replay (`replay`, `row_replay`) and the
native build both C++ libraries share (`native`)."""
