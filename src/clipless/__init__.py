"""clipless: differentially private deep learning with computed sensitivity instead of clipping.

Lipschitz layers declare certified bounds, a backpropagation for bounds gives
every layer's per-example gradient bound, Gaussian noise is calibrated to it,
and ``dp-accounting`` tracks (epsilon, delta).  See ``SPEC.md`` for the maths.
"""

from .accounting import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
)
from .bounds import BoundedModule, BoundEngine, BoundError, BoundReport, LayerBound
from .data import ArrayDataset, DataSplit, load_dataset, load_digits, load_mnist, load_tabular
from .engine import PrivacyEngine
from .layers import (
    AdaptiveLossGradientClip,
    GroupSort,
    InputNormClip,
    L2NormPool2d,
    LayerCentering,
    LipschitzConv2d,
    LipschitzLinear,
    LossGradientClip,
    MaxMin,
    Permute,
    Residual,
    ScaledAvgPool2d,
)
from .losses import (
    BinaryCrossEntropyWithTemperature,
    CrossEntropyWithTemperature,
    KCosineSimilarity,
    LipschitzLoss,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
)
from .logit_dp import logit_dp_sensitivity, naive_dp_sensitivity, pair_gradient_norms
from .models import (
    build_loss,
    build_model,
    lipschitz_cnn,
    lipschitz_mixer,
    lipschitz_mlp,
    lipschitz_resnet,
    lipschitz_vgg,
)
from .optimizer import DPOptimizer
from .pairs import AugmentedPairs, GivenPairs
from .pretrain import ContrastivePretrainer, PretrainResult, knn_accuracy, linear_probe_accuracy
from .sampling import PoissonBatchSampler, poisson_data_loader
from .tightness import TightnessMonitor, per_example_gradient_norms, tightness
from .trainer import PrivateTrainer, TrainResult, evaluate

__version__ = "0.1.0"

__all__ = [
    "AdaptiveLossGradientClip",
    "ArrayDataset",
    "AugmentedPairs",
    "ContrastivePretrainer",
    "GivenPairs",
    "PretrainResult",
    "knn_accuracy",
    "linear_probe_accuracy",
    "logit_dp_sensitivity",
    "naive_dp_sensitivity",
    "pair_gradient_norms",
    "BinaryCrossEntropyWithTemperature",
    "BoundEngine",
    "BoundError",
    "BoundReport",
    "BoundedModule",
    "CrossEntropyWithTemperature",
    "DPOptimizer",
    "DataSplit",
    "GroupSort",
    "InputNormClip",
    "KCosineSimilarity",
    "L2NormPool2d",
    "LayerBound",
    "LayerCentering",
    "LipschitzConv2d",
    "LipschitzLinear",
    "LipschitzLoss",
    "LossGradientClip",
    "MaxMin",
    "Permute",
    "MulticlassHKR",
    "MulticlassHinge",
    "MulticlassKR",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "PrivacyEngine",
    "PrivateTrainer",
    "Residual",
    "ScaledAvgPool2d",
    "TauCrossEntropy",
    "TightnessMonitor",
    "TrainResult",
    "build_loss",
    "build_model",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compute_epsilon",
    "effective_noise_multiplier",
    "evaluate",
    "lipschitz_cnn",
    "lipschitz_mixer",
    "lipschitz_mlp",
    "lipschitz_resnet",
    "lipschitz_vgg",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_tabular",
    "per_example_gradient_norms",
    "poisson_data_loader",
    "tightness",
]
