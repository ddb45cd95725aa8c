"""What every part of the runtime builds on and nothing of the runtime: the torch APIs
that moved between supported releases (torch_compat.py) and random draws that leave the
caller's generators alone (random_state.py)."""
