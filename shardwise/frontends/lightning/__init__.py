"""PyTorch Lightning's Trainer on a shardwise engine.

`shardwise.frontends.lightning.strategy.ShardwiseStrategy` (needs the `lightning` extra)
is a Lightning strategy in the shape of Lightning's DeepSpeedStrategy; importing it also
registers the names "shardwise" and "shardwise_stage_1/2/3". Nothing is imported here, so
`import shardwise` never pulls in Lightning.
"""
