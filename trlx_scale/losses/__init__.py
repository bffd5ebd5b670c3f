"""The objectives, as pure tensor functions (no trainer state), each checked by hand in tests.

What runs where (said plainly, because TRL computes the policy loss inline with no hook):

- ``log_importance_weights`` (policy_losses.py): token / sequence (GSPO) / sequence_token (GSPO-token) log weights.
  The trainers call it: GRPOTrainer's ``_postprocess_loss_logps`` seam turns the loss pass's log-probs into
  GSPO-token's weights before TRL's token branch uses them.
- the clipped surrogate that TRL's ``_compute_loss`` computes for GRPO and PPO is not restated here (the trainers
  use TRL's); ``tests/helpers/policy_loss_reference.py`` holds the reference TRL's loss is checked against, for all
  three ratio levels (tests/test_gspo.py), so a TRL change to that loss fails a test.
- ``clipped_value_loss`` (value_loss.py): PPO's value objective; PPOTrainer's ``_compute_loss`` adds it to TRL's
  policy loss.
- ``vllm_importance_sampling.py``: the importance weights of the off-policy correction (pi_old / pi_sampling,
  truncated or masked), the package's one place for them: the loss pass's deferred correction, the asynchronous
  trainer's geometric mean per sequence and its ``async/*`` metrics. The decoupled objective they serve is stated
  as pure functions in ``tests/helpers/decoupled_objective.py``, the reference the asynchronous trainer's loss is
  held to.

Advantage estimation (GAE, KL-penalized rewards, whitening) shapes the rewards rather than the objective and lives
in ``trlx_scale.ppo``. A new objective goes here as a pure function with a hand-count test, and reaches a trainer
through one hook: ``_postprocess_loss_logps`` for a new ratio, an overridden ``_compute_loss`` for an added term
(docs/contributing.md walks through both).
"""

from .policy_losses import LEVELS, log_importance_weights
from .value_loss import clipped_value_loss

__all__ = ["LEVELS", "clipped_value_loss", "log_importance_weights"]
