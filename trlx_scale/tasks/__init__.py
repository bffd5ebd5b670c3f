"""The demo harness, kept apart from the library: the embedded tiny default model, the toy two-digit addition task,
held-out evaluation, and what the examples share (their runtime and end-of-run summary).

Nothing in the library imports from here; ``examples/`` and the tests do:

    from trlx_scale.tasks import addition_dataset, default_model_path, exact_match_reward
"""

from .addition import addition_dataset, addition_preference_dataset, exact_match_reward
from .default_model import default_model_path

__all__ = ["addition_dataset", "addition_preference_dataset", "default_model_path", "exact_match_reward"]
