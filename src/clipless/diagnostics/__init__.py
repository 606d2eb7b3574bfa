"""Checks of a model and a run: bound tightness, robustness certificates, empirical privacy audits
(white-box step, one training run, membership attacks), plots."""

from .audit_stats import AuditResult
from .membership import (
    dp_advantage_bound,
    loss_threshold_attack,
    membership_audit,
    shadow_model_attack,
    shadow_model_scores,
)
from .one_run import loss_scores, mislabelled_canaries, one_run_audit
from .robustness import certified_accuracy, certified_radii
from .step_audit import audit_step, craft_canary
from .tightness import TightnessMonitor, per_example_gradient_norms, tightness

__all__ = [
    "AuditResult",
    "TightnessMonitor",
    "audit_step",
    "certified_accuracy",
    "certified_radii",
    "craft_canary",
    "dp_advantage_bound",
    "loss_scores",
    "loss_threshold_attack",
    "membership_audit",
    "mislabelled_canaries",
    "one_run_audit",
    "per_example_gradient_norms",
    "shadow_model_attack",
    "shadow_model_scores",
    "tightness",
]
