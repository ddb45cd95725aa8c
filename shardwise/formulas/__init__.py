"""The memory and communication laws (docs/formulas.md), as plain arithmetic: the runtime's
accounting, the planner, the main job's report and the tests all use these functions, so
a measured byte and its formula can be compared to the byte. Nothing here imports torch.distributed."""
