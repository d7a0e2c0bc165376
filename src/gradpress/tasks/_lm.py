"""Pieces shared by the byte-level language-model tasks (``stdlib-mlm``, ``stdlib-lm``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .base import EvalResult, model_device

#: ``(start, stop, device) -> (logits (N, vocab), targets (N,))`` of validation examples
#: ``start:stop``.
LogitsAndTargets = Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]


def normal_init(module: nn.Module) -> None:
    """BERT's and GPT-2's initialisation: weights normal(0, 0.02), biases zero, LayerNorm (1, 0)
    (``nn.LayerNorm``'s own defaults); for ``model.apply``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        bias: torch.Tensor | None = getattr(module, "bias", None)  # Embedding has none
        if bias is not None:
            nn.init.zeros_(bias)
    elif isinstance(module, nn.MultiheadAttention):
        nn.init.normal_(module.in_proj_weight, std=0.02)
        nn.init.zeros_(module.in_proj_bias)


@torch.no_grad()
def evaluate_tokens(model: nn.Module, num_examples: int, batch_size: int,
                    logits_and_targets: LogitsAndTargets) -> EvalResult:
    """Validation loss (primary), token accuracy and perplexity over the fixed validation
    examples, ``batch_size`` at a time, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    total_loss, correct, count = 0.0, 0, 0
    try:
        for start in range(0, num_examples, batch_size):
            logits, targets = logits_and_targets(start, start + batch_size, device)
            total_loss += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(dim=1) == targets).sum())
            count += int(targets.numel())
    finally:
        model.train(was_training)
    loss = total_loss / count
    return EvalResult({"val_loss": loss, "val_accuracy": correct / count,
                       "val_perplexity": math.exp(min(loss, 50.0))},
                      primary="val_loss", higher_is_better=False, num_examples=count)
