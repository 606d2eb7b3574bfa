"""Private contrastive / spreadout pre-training: Logit-DP (Kong et al.) and Naive-DP (spec §4)."""

from .evaluation import evaluate_encoder, few_label_probe_accuracy, knn_accuracy, linear_probe_accuracy
from .logit_dp import logit_dp_sensitivity, naive_dp_sensitivity, pair_gradient_norms
from .pairs import AugmentedPairs, GivenPairs
from .pretrain import ContrastivePretrainer, PretrainResult

__all__ = ["AugmentedPairs", "ContrastivePretrainer", "GivenPairs", "PretrainResult", "evaluate_encoder",
           "few_label_probe_accuracy", "knn_accuracy", "linear_probe_accuracy", "logit_dp_sensitivity",
           "naive_dp_sensitivity", "pair_gradient_norms"]
