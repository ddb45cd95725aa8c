"""Sequence parallelism: Ulysses (ulysses.py: all-to-all attention over the sequence
group; importing it registers the apply stage's "sequence_parallel" step) and Megatron's
(megatron.py: inside the tensor group, applied with tensor parallelism). The package
imports nothing itself, so tensor-parallel modules can use its all-to-all without a cycle."""
