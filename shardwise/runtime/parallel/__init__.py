"""Model transformations applied before ZeRO takes over the parameters (apply.py)."""
