"""Pushing a run to the Hugging Face Hub: only this run's files, retried, with a model card that says what ran."""

from .model_card import trlx_scale_card_section
from .push import HubPush, HubPushError

__all__ = ["HubPush", "HubPushError", "trlx_scale_card_section"]
