"""`deepspeed.sequence`: Megatron-DeepSpeed's Ulysses attention, `DistributedAttention`
(layer.py), which long-context training scripts wrap around their own attention.
Imported when named, as in DeepSpeed. DeepSpeed's `fpdt_layer` (FPDT, chunked attention
with offloading, ~1,350 lines of CUDA-stream code) is not provided."""
