"""PyTorch Lightning's Trainer and Lightning Fabric on a shardwise engine.

`shardwise.frontends.lightning.strategy.ShardwiseStrategy` (the Trainer's) and
`shardwise.frontends.lightning.fabric.ShardwiseFabricStrategy` (Fabric's), both needing
the `lightning` extra, are strategies in the shape of Lightning's DeepSpeedStrategy;
importing each registers the names "shardwise" and "shardwise_stage_1/2/3" in its
framework's registry. Nothing is imported here, so `import shardwise` never pulls in
Lightning.
"""
