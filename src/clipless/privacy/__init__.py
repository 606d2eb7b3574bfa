"""The privacy core: certified bounds, guards, accounting, noise calibration, sampling, the private optimizer.

It imports nothing else of clipless; layers and losses take part through the protocols of
:mod:`clipless.privacy.modules`.
"""

from .accounting import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
)
from .bounds import BoundEngine, BoundReport
from .calibration import BudgetExhaustedError, NoisePlan, plan_noise
from .certified import BoundError
from .input_guard import InputGuard, StepGuard
from .modules import (
    BoundedModule,
    DeclaredConstants,
    InputClip,
    LayerBound,
    LipschitzLoss,
    PerStepMechanism,
    Residual,
)
from .optimizer import DPOptimizer
from .privacy_engine import PrivacyEngine
from .randomness import make_generator, secret_generator
from .sampling import PoissonBatchSampler, PoissonDataLoader, physical_batches, poisson_data_loader

__all__ = [
    "BoundEngine",
    "BoundError",
    "BoundReport",
    "BoundedModule",
    "BudgetExhaustedError",
    "DPOptimizer",
    "DeclaredConstants",
    "InputClip",
    "InputGuard",
    "LayerBound",
    "LipschitzLoss",
    "NoisePlan",
    "PerStepMechanism",
    "PoissonBatchSampler",
    "PoissonDataLoader",
    "PrivacyAccountant",
    "PrivacyEngine",
    "Residual",
    "StepGuard",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "compute_epsilon",
    "effective_noise_multiplier",
    "make_generator",
    "physical_batches",
    "plan_noise",
    "poisson_data_loader",
    "secret_generator",
]
