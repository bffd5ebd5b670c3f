"""The log-prob passes: how a batch of (prompt, completion) rows goes through a model to give per-token log-probs.

One interface (``logprob_pass.LogProbPass``), one implementation per layout of the forward: ``padded`` (TRL's pass,
each row prompt + completion, padded), ``packed`` (padding-free rows: ``PackedPass``, laid out by ``packed_rows``
and the micro-batch planner ``micro_batch_plan``), ``shared_prefix`` (each group's prompt once; ``SharedPrefixPass``,
which falls back to the packed or padded pass for chunks without a repeated prompt). A trainer picks one per batch; every pass returns the log-probs, the entropies and
the tokens it actually processed, so the profiler's FLOPs and the token ratio come from the pass, not from the
batch's padded shape.
"""

from .logprob_pass import LogProbPass, PassRequest, PassResult
from .packed import PackedPass
from .padded import PaddedPass
from .shared_prefix import SharedPrefixPass

__all__ = ["LogProbPass", "PackedPass", "PaddedPass", "PassRequest", "PassResult", "SharedPrefixPass"]
