"""`deepspeed.runtime.pipe`: the pipeline module classes, the process topology
and the schedules."""

from shardwise.frontends.deepspeed.api.runtime.pipe import module, schedule, topology
from shardwise.frontends.deepspeed.api.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.frontends.deepspeed.api.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "module", "schedule", "topology"]
