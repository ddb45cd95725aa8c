"""In the shape of DeepSpeedExamples' training/HelloDeepSpeed/train_bert_ds.py: a RoBERTa
masked-LM (Hugging Face, random init) trained by the DeepSpeed engine, checkpointed with
`client_state` and resumed with `load_checkpoint`, run by `shardwise run --as-deepspeed`.

Changed for a test: random character "texts" and a character tokenizer instead of
wikitext and roberta-base (nothing downloaded), a tiny model, argparse instead of
`fire`, the standard logger instead of loguru, and the plain-PyTorch reference
(`--plain-torch`: the loop of the original train_bert.py, torch.save checkpoints).
As in the original, every rank reads the same batches (a plain shuffled DataLoader).
"""

import argparse
import json
import logging
import os
import pathlib
import random
import re
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Tuple, TypeVar

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead, RobertaPreTrainedModel

from reference import add_reference_arguments, write_losses

logger = logging.getLogger("train_bert")
logging.basicConfig(level=logging.INFO)


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log_dist(message: str, ranks: List[int] = [], level: int = logging.INFO) -> None:
    """Log messages for specified ranks only"""
    my_rank = int(os.environ.get("RANK", "0"))
    if my_rank in ranks:
        logger.log(level, f"[Rank {my_rank}] {message}")


class CharacterTokenizer:
    """Stands in for roberta-base's tokenizer: ids 0-3 special, one id per character."""

    bos_token_id, pad_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    vocab_size = 64
    all_special_ids = [0, 1, 2, 3]

    def encode(self, text: str, add_special_tokens: bool = False, truncation: bool = True, max_length: int = 512):
        return [4 + ord(character) % 60 for character in text][:max_length]


def collate_function(batch: List[Tuple[List[int], List[int]]], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """Collect a list of masked token indices, and labels, and batch them, padding to max length in the batch."""
    max_length = max(len(token_ids) for token_ids, _ in batch)
    padded_token_ids = [token_ids + [pad_token_id for _ in range(0, max_length - len(token_ids))]
                        for token_ids, _ in batch]
    padded_labels = [labels + [pad_token_id for _ in range(0, max_length - len(labels))] for _, labels in batch]
    src_tokens = torch.LongTensor(padded_token_ids)
    tgt_tokens = torch.LongTensor(padded_labels)
    attention_mask = src_tokens.ne(pad_token_id).type_as(src_tokens)
    return {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "attention_mask": attention_mask}


def masking_function(text, tokenizer, mask_prob, random_replace_prob, unmask_replace_prob, max_length):
    """Given a text string, randomly mask wordpieces for Bert MLM training (as the original)."""
    tokenized_ids = ([tokenizer.bos_token_id]
                     + tokenizer.encode(text, add_special_tokens=False, truncation=True, max_length=max_length - 2)
                     + [tokenizer.eos_token_id])
    seq_len = len(tokenized_ids)
    tokenized_ids = np.array(tokenized_ids)
    subword_mask = np.full(len(tokenized_ids), False)
    low = 1
    high = len(subword_mask) - 1
    mask_choices = np.arange(low, high)
    num_subwords_to_mask = max(int((mask_prob * (high - low)) + np.random.rand()), 1)
    subword_mask[np.random.choice(mask_choices, num_subwords_to_mask, replace=False)] = True
    labels = np.full(seq_len, tokenizer.pad_token_id)
    labels[subword_mask] = tokenized_ids[subword_mask]
    tokenized_ids[subword_mask] = tokenizer.mask_token_id
    rand_or_unmask_prob = random_replace_prob + unmask_replace_prob
    if rand_or_unmask_prob > 0:
        rand_or_unmask = subword_mask & (np.random.rand(len(tokenized_ids)) < rand_or_unmask_prob)
        unmask_prob = unmask_replace_prob / rand_or_unmask_prob
        decision = np.random.rand(len(tokenized_ids)) < unmask_prob
        unmask = rand_or_unmask & decision
        rand_mask = rand_or_unmask & (~decision)
        tokenized_ids[unmask] = labels[unmask]
        weights = np.ones(tokenizer.vocab_size)
        weights[tokenizer.all_special_ids] = 0
        probs = weights / weights.sum()
        tokenized_ids[rand_mask] = np.random.choice(tokenizer.vocab_size, rand_mask.sum(), p=probs)
    return tokenized_ids.tolist(), labels.tolist()


class TextMLMDataset(Dataset):
    def __init__(self, texts: List[str], masking_function: Callable[[str], Tuple[List[int], List[int]]]) -> None:
        self.texts = texts
        self.masking_function = masking_function

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, idx: int) -> Tuple[List[int], List[int]]:
        tokens, labels = self.masking_function(self.texts[idx])
        return (tokens, labels)


T = TypeVar("T")


class InfiniteIterator(object):
    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable
        self._iterator = iter(self._iterable)

    def __iter__(self):
        return self

    def __next__(self) -> T:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(mask_prob, random_replace_prob, unmask_replace_prob, batch_size, max_seq_length=32):
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    generator = random.Random(7)
    texts = ["".join(generator.choice(alphabet) for _ in range(generator.randint(8, 40))) for _ in range(256)]
    tokenizer = CharacterTokenizer()
    masking_function_partial = partial(masking_function, tokenizer=tokenizer, mask_prob=mask_prob,
                                       random_replace_prob=random_replace_prob,
                                       unmask_replace_prob=unmask_replace_prob, max_length=max_seq_length)
    dataset = TextMLMDataset(texts, masking_function_partial)
    collate_fn_partial = partial(collate_function, pad_token_id=tokenizer.pad_token_id)
    dataloader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn_partial)
    return InfiniteIterator(dataloader)


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config: RobertaConfig, embedding_weight: Optional[torch.Tensor] = None) -> None:
        super(RobertaLMHeadWithMaskedPredict, self).__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features: torch.Tensor, masked_token_indices: Optional[torch.Tensor] = None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel) -> None:
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        sequence_output, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        pad_token_id = self.config.pad_token_id
        masked_token_indexes = torch.nonzero((tgt_tokens != pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout) -> RobertaMLMModel:
    roberta_config = RobertaConfig.from_dict({
        "attention_probs_dropout_prob": dropout, "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "gelu",
        "hidden_dropout_prob": dropout, "hidden_size": h_dim, "initializer_range": 0.02, "intermediate_size": ff_dim,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 64, "model_type": "roberta",
        "num_attention_heads": num_heads, "num_hidden_layers": num_layers, "pad_token_id": 1, "type_vocab_size": 1,
        "vocab_size": CharacterTokenizer.vocab_size,
    })
    return RobertaMLMModel(roberta_config, RobertaModel(roberta_config))


def create_experiment_dir(checkpoint_dir: pathlib.Path, all_arguments) -> pathlib.Path:
    exp_dir = checkpoint_dir / "bert_pretrain"
    if not is_rank_0():
        return exp_dir
    exp_dir.mkdir(exist_ok=False)
    with (exp_dir / "hparams.json").open("w") as handle:
        json.dump(obj=all_arguments, fp=handle, indent=2)
    return exp_dir


def load_model_checkpoint(load_checkpoint_dir: pathlib.Path, model, optimizer):
    """The original train_bert.py's loader (the plain-PyTorch path)."""
    checkpoint_files = [path for path in load_checkpoint_dir.glob("*.pt") if re.search(r"iter_(?P<iter_no>\d+)\.pt", path.name)]
    assert len(checkpoint_files) > 0, "No checkpoints found in directory"
    latest = max(checkpoint_files, key=lambda path: int(re.search(r"iter_(?P<iter_no>\d+)\.pt", path.name).group("iter_no")))
    state_dict = torch.load(latest)
    model.load_state_dict(state_dict["model"], strict=True)
    optimizer.load_state_dict(state_dict["optimizer"])
    return int(re.search(r"iter_(?P<iter_no>\d+)\.pt", latest.name).group("iter_no")), model, optimizer


def train(checkpoint_dir=None, load_checkpoint_dir=None, mask_prob=0.15, random_replace_prob=0.1,
          unmask_replace_prob=0.1, max_seq_length=32, num_layers=2, num_heads=2, ff_dim=64, h_dim=32, dropout=0.0,
          batch_size=4, num_iterations=5, checkpoint_every=2, log_every=1, local_rank=-1, dtype="fp32",
          zero_stage=1, offload=True, plain_torch=False, loss_file=None):
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if (local_rank > -1) and get_accelerator().is_available() else torch.device("cpu"))
    if checkpoint_dir:
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        checkpoint_dir.mkdir(exist_ok=True)
        exp_dir = create_experiment_dir(checkpoint_dir, {"batch_size": batch_size, "num_iterations": num_iterations,
                                                         "checkpoint_every": checkpoint_every})
    else:
        load_checkpoint_dir = pathlib.Path(load_checkpoint_dir)
        with (load_checkpoint_dir / "hparams.json").open("r") as handle:
            hparams = json.load(handle)
        num_iterations = max(num_iterations, hparams.get("num_iterations", num_iterations))
        exp_dir = load_checkpoint_dir
    data_iterator = create_data_iterator(mask_prob=mask_prob, random_replace_prob=random_replace_prob,
                                         unmask_replace_prob=unmask_replace_prob, max_seq_length=max_seq_length,
                                         batch_size=batch_size)
    model = create_model(num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout)
    if plain_torch:
        return train_plain(model, data_iterator, exp_dir, load_checkpoint_dir, num_iterations, checkpoint_every,
                           loss_file)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "gradient_clipping": 0.0,  # the plain loop does not clip; DeepSpeed 0.19.8 clips at 1.0 without the key
        "zero_optimization": {"stage": zero_stage, "offload_optimizer": {"device": "cpu" if offload else "none"}},
    }
    if dtype != "fp32":
        ds_config[dtype] = {"enabled": True}
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    log_dist(f"Total number of model parameters: {sum([p.numel() for p in model.parameters()]):,d}", ranks=[0])
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % log_every == 0:
            log_dist("Loss: {0:.4f}".format(np.mean(losses)), ranks=[0], level=logging.INFO)
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    write_losses(loss_file, int(os.environ.get("RANK", "0")), losses)
    return exp_dir


def train_plain(model, data_iterator, exp_dir, load_checkpoint_dir, num_iterations, checkpoint_every, loss_file):
    """The original train_bert.py loop: torch.optim.Adam, torch.save checkpoints."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    start_step = 1
    if load_checkpoint_dir is not None:
        checkpoint_step, model, optimizer = load_model_checkpoint(load_checkpoint_dir, model, optimizer)
        start_step = checkpoint_step + 1
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        optimizer.zero_grad()
        loss = model(**batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, exp_dir / f"iter_{step}.pt")
    if step % checkpoint_every != 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, exp_dir / f"iter_{step}.pt")
    for rank in range(2):  # every rank of the parallel run reads the same batches
        write_losses(loss_file, rank, losses)
    return exp_dir


if __name__ == "__main__":
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    parser = argparse.ArgumentParser(description="train_bert_ds (argparse in place of fire)")
    for name, default in [("checkpoint_dir", None), ("load_checkpoint_dir", None), ("dtype", "fp32")]:
        parser.add_argument(f"--{name}", default=default)
    for name, default in [("num_iterations", 5), ("checkpoint_every", 2), ("local_rank", -1), ("zero_stage", 1),
                          ("batch_size", 4)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--no-offload", dest="offload", action="store_false")
    add_reference_arguments(parser)
    arguments = vars(parser.parse_args())
    arguments.pop("world_size")
    train(**arguments)
