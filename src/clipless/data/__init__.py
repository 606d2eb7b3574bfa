"""Datasets (embedded digits, MNIST IDX files, tabular files) and fixed feature maps; nothing is downloaded."""

from .augment import ImageAugmentation
from .datasets import (
    ArrayDataset,
    DataSplit,
    check_finite,
    check_held_out,
    clip_norm,
    convert_colour_space,
    input_norms,
    load_dataset,
    load_digits,
    load_cifar10,
    load_image_folder,
    load_idx_images,
    load_mnist,
    load_tabular,
    normalize_to_sphere,
    read_idx,
    signed_log1p,
    signed_sqrt,
)

__all__ = ["ArrayDataset", "ImageAugmentation", "DataSplit", "check_finite", "check_held_out", "clip_norm", "convert_colour_space", "input_norms", "load_dataset", "load_digits", "load_cifar10", "load_idx_images", "load_image_folder", "load_mnist", "load_tabular", "normalize_to_sphere", "read_idx", "signed_log1p", "signed_sqrt"]
