"""ZeRO-Offload and ZeRO-Infinity: shard stores whose bytes live in host memory or NVMe files."""
