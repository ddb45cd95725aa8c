"""The runtime: engine, ZeRO and its stores, parallelisms, recomputation, optimizers,
precision, checkpoints, on torch.distributed. It is built from typed policies and a mesh,
and imports nothing from the front ends, the models or the tools."""
