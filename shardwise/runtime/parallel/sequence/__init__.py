"""Sequence parallelism: Ulysses (ulysses.py: all-to-all attention over the sequence
group) and Megatron's (megatron.py: inside the tensor group). The package imports nothing
itself, so a model family's attention can use the all-to-all alone."""
