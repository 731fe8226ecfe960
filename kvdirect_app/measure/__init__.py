"""Measurement, outside the strategies: observers of what a lane holds (`observe`), the memory instruments
(`instruments`, `meters`, `memory`), the allocator's ledger in C++ (`ledger`, with `ledger.cpp`), step timing
(`timing`) and the free run's agreement with the reference (`agreement`)."""
