"""DPO building blocks as pure functions: (best, worst) preference pairs from scored samples, summed completion
log-probs from the engine, and the pair balance across ranks of online DPO."""

from .online_pair_balance import balance_pairs, check_multi_process_online_loss, tie_pair_loss
from .preference_pairs import best_worst_pairs, completion_logprob_sums

__all__ = [
    "balance_pairs",
    "best_worst_pairs",
    "check_multi_process_online_loss",
    "completion_logprob_sums",
    "tie_pair_loss",
]
