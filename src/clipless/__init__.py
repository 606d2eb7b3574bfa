"""clipless: differentially private deep learning with computed sensitivity instead of clipping.

Lipschitz layers declare certified bounds, a backpropagation for bounds gives every layer's per-example
gradient bound, Gaussian noise is calibrated to it, and ``dp-accounting`` tracks (epsilon, delta); see
``docs/spec.md`` for the maths.  This namespace holds the privacy core (:mod:`clipless.privacy`), the layers
and losses (:mod:`clipless.nn`), training (:mod:`clipless.train`) and data (:mod:`clipless.data`);
:mod:`clipless.contrastive`, :mod:`clipless.kl` and :mod:`clipless.diagnostics` are namespaces.
"""

import importlib
import warnings
from typing import Any

from . import contrastive, data, diagnostics, kl, nn, privacy, train
from .data import (
    ArrayDataset,
    DataSplit,
    load_dataset,
    load_digits,
    load_mnist,
    load_tabular,
)
from .nn import (
    AdaptiveLossGradientClip,
    BinaryCrossEntropyWithTemperature,
    CrossEntropyWithTemperature,
    GroupSort,
    InputNormClip,
    KCosineSimilarity,
    L2NormPool2d,
    LayerCentering,
    LipschitzConv2d,
    LipschitzLinear,
    LossGradientClip,
    MaxMin,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    OrthogonalConv2d,
    Permute,
    ScaledAvgPool2d,
    TauCrossEntropy,
    build_loss,
    build_model,
    export,
    lipschitz_cnn,
    lipschitz_mixer,
    lipschitz_mlp,
    lipschitz_resnet,
    lipschitz_vgg,
    to_lipschitz,
)
from .privacy import (
    BoundedModule,
    BoundEngine,
    BoundError,
    BoundReport,
    BudgetExhaustedError,
    DPOptimizer,
    LayerBound,
    LipschitzLoss,
    PoissonBatchSampler,
    PoissonDataLoader,
    PrivacyAccountant,
    PrivacyEngine,
    Residual,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
    physical_batches,
    poisson_data_loader,
)
from .train import PrivateTrainer, TrainResult, evaluate

__version__ = "0.1.0"

__all__ = [
    "AdaptiveLossGradientClip",
    "ArrayDataset",
    "BinaryCrossEntropyWithTemperature",
    "BoundEngine",
    "BoundError",
    "BoundReport",
    "BoundedModule",
    "BudgetExhaustedError",
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
    "MulticlassHKR",
    "MulticlassHinge",
    "MulticlassKR",
    "OrthogonalConv2d",
    "Permute",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "PrivacyAccountant",
    "PrivacyEngine",
    "PrivateTrainer",
    "Residual",
    "ScaledAvgPool2d",
    "TauCrossEntropy",
    "TrainResult",
    "build_loss",
    "build_model",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compute_epsilon",
    "contrastive",
    "data",
    "diagnostics",
    "effective_noise_multiplier",
    "evaluate",
    "export",
    "kl",
    "lipschitz_cnn",
    "lipschitz_mixer",
    "lipschitz_mlp",
    "lipschitz_resnet",
    "lipschitz_vgg",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_tabular",
    "nn",
    "physical_batches",
    "poisson_data_loader",
    "privacy",
    "to_lipschitz",
    "train",
]

# Names that lived here before the namespaces (see CHANGELOG.md): kept for one release, with a warning.
_MOVED = {
    "AugmentedPairs": "contrastive", "ContrastivePretrainer": "contrastive", "GivenPairs": "contrastive",
    "PretrainResult": "contrastive", "knn_accuracy": "contrastive", "linear_probe_accuracy": "contrastive",
    "logit_dp_sensitivity": "contrastive", "naive_dp_sensitivity": "contrastive",
    "pair_gradient_norms": "contrastive", "TightnessMonitor": "diagnostics", "per_example_gradient_norms":
    "diagnostics", "tightness": "diagnostics",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        where = f"clipless.{_MOVED[name]}"
        warnings.warn(f"clipless.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'clipless' has no attribute {name!r}")
