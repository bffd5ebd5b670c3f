"""Model-forward techniques used by the trainers (shared-prefix log-prob pass)."""
