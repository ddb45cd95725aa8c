"""Expert parallelism: a mixture-of-experts layer (layer.py: the router of gating.py, the
experts, the routes of routing.py) whose experts are split over an expert group carved
from the data-parallel ranks, tokens exchanged by all-to-all (exchange.py), and the
experts' gradients summed over the ranks holding the same ones (training.py)."""

from shardwise.runtime.parallel.expert.exchange import exchange_with_experts
from shardwise.runtime.parallel.expert.gating import TopKGate, top1_gating, top2_gating
from shardwise.runtime.parallel.expert.layer import ExpertList, MixtureOfExperts, shard_expert_layers
from shardwise.runtime.parallel.expert.marking import (ExpertParallelLayer, ExpertPlace, expert_parallel_size,
                                                       mark_expert_parameters)
from shardwise.runtime.parallel.expert.training import ExpertTraining

__all__ = ["ExpertList", "ExpertParallelLayer", "ExpertPlace", "ExpertTraining", "MixtureOfExperts", "TopKGate",
           "exchange_with_experts", "expert_parallel_size", "mark_expert_parameters", "shard_expert_layers",
           "top1_gating", "top2_gating"]
