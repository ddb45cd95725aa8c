"""`deepspeed.runtime.utils`: `set_random_seed`, which DeepSpeed's example scripts call."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
