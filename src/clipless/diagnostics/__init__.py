"""Checks of a model and a run: bound tightness, robustness certificates, membership attacks, plots."""

from .membership import dp_advantage_bound, loss_threshold_attack, shadow_model_attack
from .robustness import certified_accuracy, certified_radii
from .tightness import TightnessMonitor, per_example_gradient_norms, tightness

__all__ = ["TightnessMonitor", "certified_accuracy", "certified_radii", "dp_advantage_bound", "loss_threshold_attack", "per_example_gradient_norms", "shadow_model_attack", "tightness"]
