"""TRL's trainers (SFTTrainer, DPOTrainer, RewardTrainer, ...) on a shardwise engine.

`shardwise.frontends.trl.trainers.shardwise_trainer(SFTTrainer)` is the trainer class
with shardwise's engine (needs the `trl` extra). Nothing is imported here, so
`import shardwise` never pulls in `trl`.
"""
