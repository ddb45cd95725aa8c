"""`deepspeed.runtime.activation_checkpointing`, where DeepSpeed keeps `checkpointing`."""
