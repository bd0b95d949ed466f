"""Real-GPU checks: CUDA workloads checkpointed and restored. Skipped cleanly without a GPU."""
