"""Before-launch planning: per-role, per-GPU memory estimates (``megarl plan``) and launch sizing."""
