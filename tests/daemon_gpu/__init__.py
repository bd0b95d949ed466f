"""CPU-only tests of the GPU orchestration, against the fake driver through the real worker."""
