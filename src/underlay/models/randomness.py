"""Training-mode randomness of a transformers model, as a decision: :func:`set_training_mode`."""

from __future__ import annotations

from typing import Literal

from torch import nn

from underlay.interfaces import ConfigError

__all__ = ["TRAINING_RANDOMNESS", "TrainingRandomness", "set_training_mode"]

TrainingRandomness = Literal["off", "keep"]
TRAINING_RANDOMNESS: tuple[str, ...] = ("off", "keep")
"""The values of ``ModelConfig.training_randomness``."""


def set_training_mode(model: nn.Module, randomness: str) -> nn.Module:
    """Put ``model`` in its training mode for a forward/backward pass, in place; returns ``model``.

    ``randomness="keep"``: ``model.train()``: every module in training mode, so dropout (residual,
    embedding, MLP, classifier), MoE router jitter and any other ``self.training``-gated randomness of
    the model apply, as in transformers' own training. ``"off"`` (the RL default): every module in
    evaluation mode, so none of them applies and a training forward computes what an inference forward
    computes, except the modules that transformers' activation checkpointing needs in training mode
    (those whose ``gradient_checkpointing`` flag is set: the decoder layers), which alone keep
    ``training=True`` (not their children); their own forward only uses the flag to checkpoint.
    Raises ``ConfigError`` for any other value.
    """
    if randomness not in TRAINING_RANDOMNESS:
        raise ConfigError(
            f"training_randomness={randomness!r}: use 'off' (no dropout, no router jitter: training and "
            "inference forwards agree) or 'keep' (the model's training-mode randomness applies)"
        )
    if randomness == "keep":
        return model.train()
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True
    return model
