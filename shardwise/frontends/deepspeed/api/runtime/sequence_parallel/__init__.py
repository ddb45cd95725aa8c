"""`deepspeed.runtime.sequence_parallel`: Arctic Long Sequence Training's Ulysses for
Hugging Face models (`ulysses_sp`) and the parallel state it returns as its `mpu`
(`parallel_state_sp`). Imported when named, as in DeepSpeed."""
