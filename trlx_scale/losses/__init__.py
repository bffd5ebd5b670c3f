from .policy_losses import LEVELS, clipped_policy_loss, log_importance_weights
from .value_loss import clipped_value_loss

__all__ = ["LEVELS", "clipped_policy_loss", "clipped_value_loss", "log_importance_weights"]
