"""Accelerate's own ALST test script's loop (accelerate/test_utils/scripts/external_deps/
test_ds_alst_ulysses_sp.py: `ParallelismConfig(sp_backend="deepspeed")`, the adapter from
`accelerator.prepare`, the token-weighted loss), with a Llama built from a config instead
of a hub download. Writes each rank's losses to ARGV[1].rank<r>.json."""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ParallelismConfig, set_seed
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
from deepspeed.runtime.utils import move_to_device
from deepspeed.utils import groups

sys.path.insert(0, sys.argv[2])  # the repository, for the test's model and data
from tests.frontends.accelerate.alst_reference import SEQUENCES, build_model  # noqa: E402

set_seed(42)
world_size = 2
accelerator = Accelerator(parallelism_config=ParallelismConfig(
    sp_backend="deepspeed", sp_size=world_size,
    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=256, sp_seq_length_is_variable=True,
                                               sp_attn_implementation="sdpa")))
model, optimizer = build_model()
dataset = torch.utils.data.TensorDataset(SEQUENCES)


def collate_fn(batch):
    (ids,) = batch[0]
    return {"input_ids": ids.unsqueeze(0), "position_ids": torch.arange(ids.shape[0]).unsqueeze(0),
            "labels": ids.unsqueeze(0)}


loader = torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=collate_fn)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
sp_group = groups._get_sequence_parallel_group()
unwrapped = accelerator.unwrap_model(model)
losses = []
for batch in loader:
    optimizer.zero_grad()
    batch = move_to_device(batch, model.device)
    outputs = model(**batch)
    shift_labels = batch["shift_labels"]
    loss = unwrapped.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                   vocab_size=unwrapped.config.vocab_size)
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
    good = (shift_labels != -100).view(-1).sum()
    good_per_rank = torch.distributed.nn.functional.all_gather(good, group=sp_group)
    total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(world_size) if good_per_rank[r] > 0)
    loss = total / max(sum(good_per_rank), 1)
    losses.append(loss.item())
    accelerator.backward(loss)
    optimizer.step()
with open(f"{sys.argv[1]}.rank{torch.distributed.get_rank()}.json", "w") as file:
    json.dump({"losses": losses, "length": len(loader)}, file)
accelerator.end_training()
