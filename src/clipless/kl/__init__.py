"""KL privacy of noisy gradient descent without clipping (Ye et al., NeurIPS 2023; spec §5)."""

