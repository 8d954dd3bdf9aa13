"""Weight quantization formats served by rollout engines (block FP8)."""
