"""`deepspeed.runtime.pipe`: the pipeline module classes and the process topology."""

from shardwise.frontends.deepspeed.api.runtime.pipe import module, topology
from shardwise.frontends.deepspeed.api.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.frontends.deepspeed.api.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "module", "topology"]
