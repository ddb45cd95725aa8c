"""Expert parallelism: a mixture-of-experts layer's experts split over an expert group
carved from the data-parallel ranks, tokens exchanged by all-to-all (exchange.py), and
the experts' gradients summed over the ranks holding the same experts (training.py)."""

from shardwise.runtime.parallel.expert.exchange import exchange_with_experts
from shardwise.runtime.parallel.expert.marking import ExpertParallelLayer, expert_parallel_size, mark_expert_parameters
from shardwise.runtime.parallel.expert.training import ExpertTraining

__all__ = ["ExpertParallelLayer", "ExpertTraining", "exchange_with_experts", "expert_parallel_size",
           "mark_expert_parameters"]
