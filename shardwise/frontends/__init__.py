"""Front ends: the ways users describe a training job (a DeepSpeed config and script, a
Hugging Face Trainer), each turned into the runtime's policies and engine. The runtime
knows none of them."""
