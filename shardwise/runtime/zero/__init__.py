"""Data parallelism and ZeRO stages 1-3 (C1-C4): layout, gradients, optimizer, parameters."""
