"""The words of the built-in trap environment's text, shared by the environment and the tiny model's tokenizer.

An episode reads, one word per token:  `task7 stage1` → `C` → `ok stage2` → `A` → `miss stage2` → `B` …
"""

from __future__ import annotations

from async_rl.config import EnvConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
OK, MISS = "ok", "miss"
SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def task_word(task_id: int) -> str:
    return f"task{task_id}"


def stage_word(stage: int) -> str:
    return f"stage{stage + 1}"


def symbol(choice: int) -> str:
    return SYMBOLS[choice]


def vocabulary(env: EnvConfig) -> list[str]:
    return (
        [PAD, EOS, UNK, OK, MISS]
        + [task_word(t) for t in range(env.num_tasks)]
        + [stage_word(s) for s in range(env.stages)]
        + [symbol(c) for c in range(env.choices)]
    )
