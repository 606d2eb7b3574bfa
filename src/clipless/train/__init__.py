"""Training loops around the privacy core: the private trainer, checkpoints, evaluation, baselines."""

from .allocator import tune_cpu_allocator
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .evaluation import evaluate
from .trainer import PrivateTrainer, TrainResult

__all__ = ["CheckpointError", "PrivateTrainer", "TrainResult", "evaluate", "load_checkpoint", "save_checkpoint",
           "tune_cpu_allocator"]
