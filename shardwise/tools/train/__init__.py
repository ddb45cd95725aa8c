"""`shardwise train`, the main job (C23): a real training run on built-in data with live
progress, a report of measured vs. formula memory and communication, plots, TensorBoard
events, a checkpoint and a generated sample (docs/getting-started.md#the-main-job)."""
