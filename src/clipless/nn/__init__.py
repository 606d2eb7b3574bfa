"""Lipschitz layers, losses and model builders, laid out like ``torch.nn`` (one file per layer family)."""

from .clipping import AdaptiveLossGradientClip, LossGradientClip
from .conv import LipschitzConv2d, OrthogonalConv2d
from .convert import to_lipschitz
from .export import export
from .layers import (
    GroupSort,
    InputNormClip,
    L2NormPool2d,
    LayerCentering,
    MaxMin,
    Permute,
    ScaledAvgPool2d,
)
from .linear import LipschitzLinear
from .losses import (
    BinaryCrossEntropyWithTemperature,
    CrossEntropyWithTemperature,
    KCosineSimilarity,
    MulticlassHinge,
    MulticlassHKR,
    MulticlassKR,
    TauCrossEntropy,
)
from .models import (
    build_loss,
    build_lr_schedule,
    build_model,
    build_optimizer,
    lipschitz_cnn,
    lipschitz_mixer,
    lipschitz_mlp,
    lipschitz_resnet,
    lipschitz_vgg,
)

__all__ = [
    "AdaptiveLossGradientClip", "BinaryCrossEntropyWithTemperature", "CrossEntropyWithTemperature", "GroupSort",
    "InputNormClip", "KCosineSimilarity", "L2NormPool2d", "LayerCentering", "LipschitzConv2d", "LipschitzLinear",
    "LossGradientClip", "MaxMin", "MulticlassHKR", "MulticlassHinge", "MulticlassKR", "OrthogonalConv2d",
    "Permute", "ScaledAvgPool2d", "TauCrossEntropy", "build_loss", "build_lr_schedule", "build_model",
    "build_optimizer", "export", "to_lipschitz",
    "lipschitz_cnn", "lipschitz_mixer", "lipschitz_mlp", "lipschitz_resnet", "lipschitz_vgg",
]
