"""Running DeepSpeed-Chat's own training scripts (deepspeed_chat/, copied unmodified from
DeepSpeedExamples; deepspeed_chat/PROVENANCE.md) on a tiny random OPT model and synthetic prompt
data: under `shardwise run --as-deepspeed`, and, for the comparisons, under DeepSpeed
itself (DEEPSPEED_PYTHON) through torchrun, which DeepSpeed's launcher wraps.

The only data source the scripts know without a download is their `local/jsonfile`
dataset (data/train.json and data/eval.json beside dschat/), which they read with Hugging
Face's `datasets`; deepspeed_chat_standins/ holds a stand-in for the two functions used,
and the tree is copied into the test's directory so the data can be written beside it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT = HERE / "deepspeed_chat"
STANDINS = HERE / "deepspeed_chat_standins"
WORDS = [consonant + vowel for consonant in "bdgkmprst" for vowel in "aeiou"][:40]
SPACE = "\u0120"  # how GPT-2's byte-level tokenizer writes a leading space
SPECIALS = ["<pad>", "</s>", "<unk>"]
STEPS = {1: "training/step1_supervised_finetuning/main.py", 2: "training/step2_reward_model_finetuning/main.py",
         3: "training/step3_rlhf_finetuning/main.py"}
# DeepSpeed 0.19.8 on CPU at ZeRO-3 aborts at interpreter exit, after the script has finished
# and saved (its shared-memory communication op's thread): such a run counts as finished.
EXIT_ABORT = "terminate called without an active exception"
OUTPUTS = {1: "actor", 2: "critic", 3: "ppo"}
LOSS_LINE = re.compile(r"Epoch: (\d+), Step: (\d+), Rank: (\d+), loss = (?:tensor\()?([-0-9.e+naif]+)")


def prepare(directory: Path, *, records: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """(copy of the DeepSpeed-Chat tree with synthetic data, tiny OPT model directory)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    chat = directory / "DeepSpeed-Chat"
    shutil.copytree(CHAT, chat, ignore=shutil.ignore_patterns("__pycache__"))
    generator = random.Random(seed)

    def sentence(length: int) -> str:
        return " ".join(generator.choice(WORDS) for _ in range(length))

    (chat / "data").mkdir()
    for split, count in (("train", records), ("eval", records // 4)):
        rows = [{"prompt": f"Human: {sentence(4)} Assistant:", "chosen": sentence(5), "rejected": sentence(5)}
                for _ in range(count)]
        (chat / "data" / f"{split}.json").write_text(json.dumps(rows))

    model_directory = directory / "tiny-opt"
    vocabulary = _write_gpt2_tokenizer(model_directory)
    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=len(vocabulary), hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                       num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                       pad_token_id=0, bos_token_id=1, eos_token_id=1)
    OPTForCausalLM(config).save_pretrained(model_directory)
    return chat, model_directory


def _write_gpt2_tokenizer(directory: Path) -> dict[str, int]:
    """A GPT-2 byte-level BPE tokenizer as OPT checkpoints ship it (vocab.json, merges.txt:
    DeepSpeed-Chat's `save_hf_format` copies the vocabulary file, so a tokenizer.json-only
    tokenizer cannot be saved by it), whose merges make every word one token."""
    vocabulary = {token: index for index, token in enumerate(SPECIALS)}
    for character in sorted(set("".join(WORDS + ["Human:", "Assistant:"])) | {SPACE}):
        vocabulary[character] = len(vocabulary)
    merges: list[str] = []
    for word in ["Human", SPACE + "Assistant"] + [SPACE + word for word in WORDS]:
        for end in range(2, len(word) + 1):
            if word[:end] not in vocabulary:
                merges.append(f"{word[:end - 1]} {word[end - 1]}")
                vocabulary[word[:end]] = len(vocabulary)
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(vocabulary))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{merge}\n" for merge in merges))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "pad_token": "<pad>", "eos_token": "</s>", "bos_token": "</s>",
         "unk_token": "<unk>"}))
    return vocabulary


def hand_over_tokenizer(model_directory: Path, output: Path) -> None:
    """Puts the tokenizer beside a step's saved model as transformers 4 saved it, so the next
    step loads it from there. DeepSpeed-Chat saves it with `tokenizer.save_vocabulary`, which
    under transformers 5 writes the vocabulary as `tokenizer.model` (read back as a tiktoken
    file) and no longer records the base model's path in config.json; nothing to do with
    DeepSpeed or shardwise, and the same under both."""
    (output / "tokenizer.model").unlink(missing_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copyfile(model_directory / name, output / name)


def _environment(chat: Path) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    environment.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(STANDINS), str(chat)]),
                        "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    return environment


def run_step(step: int, chat: Path, arguments: list[str], *, deepspeed_python: str | None = None,
             nproc: int = 2, timeout: float = 600) -> str:
    """Step `step`'s main.py with `arguments`, under shardwise (or DeepSpeed); its stdout."""
    script = str(chat / STEPS[step])
    if deepspeed_python is None:
        command = [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--as-deepspeed", "--nproc", str(nproc),
                   script, *arguments]
    else:
        command = [deepspeed_python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   script, "--local_rank=${local_rank}", *arguments]
    result = subprocess.run(command, cwd=chat.parent, capture_output=True, text=True, timeout=timeout,
                            env=_environment(chat))
    last_line = (result.stdout.strip().splitlines() or [""])[-1]
    finished_then_aborted = (deepspeed_python is not None and EXIT_ABORT in result.stderr
                             and last_line.startswith("saving"))
    if result.returncode != 0 and not finished_then_aborted:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result.stdout


def step_arguments(step: int, directory: Path, model: Path, stage: int, *, hybrid_engine: bool = True) -> list[str]:
    """The command line DeepSpeed-Chat's README gives for `step`, shrunk to the tiny model:
    step 3 trains the actor saved by step 1 against the critic saved by step 2, with the
    hybrid engine on, as the README's step-3 scripts run it (DeepSpeed's hybrid engine needs
    its CUDA inference ops, so DeepSpeed on CPU runs step 3 without it)."""
    common = ["--data_path", "local/jsonfile", "--data_split", "2,4,4", "--dtype", "bf16", "--seed", "1234",
              "--data_output_path", str(directory / "data_files"), "--output_dir", str(directory / OUTPUTS[step])]
    if step in (1, 2):
        return common + ["--model_name_or_path", str(model), "--per_device_train_batch_size", "4",
                         "--per_device_eval_batch_size", "4", "--max_seq_len", "32", "--learning_rate", "1e-3",
                         "--zero_stage", str(stage), "--num_padding_at_beginning" if step == 2 else "--print_loss",
                         *(["0"] if step == 2 else [])]
    return common + ["--actor_model_name_or_path", str(directory / "actor"),
                     "--critic_model_name_or_path", str(directory / "critic"),
                     "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
                     "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8", "--actor_learning_rate", "1e-3",
                     "--critic_learning_rate", "1e-3", "--num_warmup_steps", "0", "--actor_zero_stage", str(stage),
                     "--critic_zero_stage", str(stage), "--num_padding_at_beginning", "0", "--print_answers",
                     *(["--enable_hybrid_engine"] if hybrid_engine else [])]


def run_steps(steps: list[int], directory: Path, chat: Path, model: Path, stage: int, *,
              deepspeed_python: str | None = None) -> dict[int, str]:
    """{step: stdout} for `steps` run in order, each step's tokenizer handed to the next."""
    printed = {}
    for step in steps:
        arguments = step_arguments(step, directory, model, stage, hybrid_engine=deepspeed_python is None)
        printed[step] = run_step(step, chat, arguments, deepspeed_python=deepspeed_python)
        if step < 3:
            hand_over_tokenizer(model, directory / OUTPUTS[step])
    return printed


def printed_losses(stdout: str) -> dict[int, list[float]]:
    """{rank: losses in order} from the scripts' `--print_loss` lines."""
    losses: dict[int, list[float]] = {}
    for _, _, rank, value in LOSS_LINE.findall(stdout):
        losses.setdefault(int(rank), []).append(float(value))
    return losses


REWARD_LINE = re.compile(r"chosen_last_scores \(higher is better\) : ([-0-9.e+]+), rejected_last_scores "
                         r"\(lower is better\) : ([-0-9.e+]+)")
PPO_LINE = re.compile(r"Step: (\d+) \| PPO Epoch: \d+ \| Actor Loss: ([-0-9.e+naif]+) \| Critic Loss: ([-0-9.e+naif]+)")


def printed_rewards(stdout: str) -> list[tuple[float, float]]:
    """Step 2's (chosen, rejected) mean reward of each evaluation, before and after training."""
    return [(float(chosen), float(rejected)) for chosen, rejected in REWARD_LINE.findall(stdout)]


def printed_ppo_losses(stdout: str) -> list[tuple[float, float]]:
    """Step 3's (actor loss, critic loss) of each PPO step, as rank 0 prints them."""
    return [(float(actor), float(critic)) for _, actor, critic in PPO_LINE.findall(stdout)]
