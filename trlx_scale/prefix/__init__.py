"""Shared-prefix forward pass for groups of completions (GRPO prefix caching on the training side)."""
