"""megarl package."""
