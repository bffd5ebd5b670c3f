from .policy_losses import LEVELS, clipped_policy_loss, log_importance_weights

__all__ = ["LEVELS", "clipped_policy_loss", "log_importance_weights"]
