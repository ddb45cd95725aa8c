"""`deepspeed.runtime.pipe.module`: where DeepSpeed defines `PipelineModule`, `LayerSpec` and
`TiedLayerSpec` (also `deepspeed.pipe`; see api/pipe/ for what they do here)."""

from shardwise.frontends.deepspeed.api.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
