"""Weight quantization formats served by rollout engines (issue 26: block FP8)."""
