"""The built-in visual task: which colour is most common in a picture of coloured shapes?

Each picture is a 3 x 3 grid of 28-pixel cells (84 x 84 pixels; one cell is one merged vision token of
the tiny Qwen2.5-VL), each holding a red, green or blue square or circle. One colour fills 5 to 7 cells;
the question is ``which colour is most common?`` and the answer that colour's name (guessing gets 1/3;
the tokenizer has the three names as tokens, as a real vocabulary would). Rows are in verl's
multimodal layout (``<image>`` placeholder, ``images`` column of ``{"bytes": PNG}``), so they go
through the same reading, processing and checks as a parquet file.

Why this question: the tiny model (0.2M parameters, trained from scratch in seconds) learns what the
whole picture shows quickly, but in our runs did not learn within a few hundred supervised steps to
pick out or count single cells ("how many red squares?", "which colour is the circle?"): see
docs/vision.md. A short supervised warm start teaches the answer's form only (a colour name drawn
at random, then EOS: :func:`format_warm_start`), so held-out accuracy starts at chance; GRPO then
teaches the model to look (``rlflow train --task vision``). Everything is made in code; nothing is
downloaded.
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass

import torch

from rlflow.data import keys as K
from rlflow.data.prompts import PromptData
from rlflow.tasks.warm_start import load_or_make

DATA_SOURCE = "rlflow/shapes"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220)}
SHAPES = ("square", "circle")
CELL, GRID = 28, 3
QUESTION = "which colour is most common?"


def draw(cells: list[tuple[str, str]]):
    """A PIL picture of the grid: ``cells[i]`` is ``(colour, shape)`` (row-major)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CELL * GRID, CELL * GRID), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for i, (colour, shape) in enumerate(cells):
        x, y, r = (i % GRID) * CELL + CELL // 2, (i // GRID) * CELL + CELL // 2, 12
        (pen.rectangle if shape == "square" else pen.ellipse)((x - r, y - r, x + r, y + r), fill=COLOURS[colour])
    return image


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def scene(rng: random.Random) -> tuple[list[tuple[str, str]], str]:
    """``(cells, most common colour)``: that colour in 5 to 7 of the 9 cells, the others in the rest."""
    most = rng.choice(list(COLOURS))
    others = [c for c in COLOURS if c != most]
    colours = [most] * rng.randint(5, 7)
    colours += [rng.choice(others) for _ in range(GRID * GRID - len(colours))]
    rng.shuffle(colours)
    return [(c, rng.choice(SHAPES)) for c in colours], most


def row(rng: random.Random) -> dict:
    cells, answer = scene(rng)
    return {"prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
            "images": [{"bytes": png(draw(cells))}], "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": answer}}


def exact_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is exactly the colour's name (surrounding spaces ignored), else 0.0."""
    return float(solution_str.strip() == ground_truth)


@dataclass(frozen=True)
class ShapesTask:
    """Training and held-out rows, fixed by seed 1234 whatever the run's seed."""
    train_size: int = 2000
    held_out: int = 200
    hidden_size: int = 64
    num_layers: int = 2
    vision_hidden_size: int = 32
    max_new_tokens: int = 3

    def splits(self) -> tuple[list[dict], list[dict]]:
        rng = random.Random(1234)
        rows = [row(rng) for _ in range(self.train_size + self.held_out)]
        return rows[: self.train_size], rows[self.train_size :]

    def processor(self):
        from rlflow.models.tiny_vlm import tiny_processor, vision_tokenizer

        return tiny_processor(min_pixels=84 * 84, max_pixels=84 * 84, tokenizer=vision_tokenizer(words=tuple(COLOURS)))

    def model(self, processor, seed: int):
        from rlflow.models.tiny_vlm import tiny_qwen2_5_vl

        return tiny_qwen2_5_vl(processor.tokenizer, hidden_size=self.hidden_size, num_layers=self.num_layers,
                               intermediate_size=4 * self.hidden_size, vision_hidden_size=self.vision_hidden_size,
                               seed=seed)

    def data(self, processor, seed: int = 0) -> PromptData:
        train, test = self.splits()
        return PromptData(train, val=test, seed=seed, processor=processor)


def format_warm_start(policy, data: PromptData, *, lr: float = 3e-3, batch_size: int = 32, max_steps: int = 300,
                      answer_log_prob: float = -1.25, eos_log_prob: float = -0.1, seed: int = 0) -> int:
    """Teach the answer's form, not the skill: supervised steps on the question *without its picture*,
    answered by a colour name drawn at random and EOS, until the training batch's mean log-prob of the
    name exceeds ``answer_log_prob`` (the optimum is log 1/3 = -1.10: the three names share all the mass)
    and of EOS ``eos_log_prob``. Returns the step count.

    Greedy accuracy stays at chance (~1/3): the model answers a colour but has never seen a picture.
    Sampling then gives a well-formed answer that is right about a third of the time, which is what GRPO
    needs to learn from. (Random names *with* the pictures would teach the model to ignore them, which
    GRPO then undoes only slowly.) The loss is the answer tokens' mean negative log-prob from
    :meth:`Policy.log_probs`, the scoring path RL uses.

    Raises:
        RuntimeError: if the criterion is not met within ``max_steps``.
    """
    tok = policy.tokenizer
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    names = torch.tensor(tok.convert_tokens_to_ids(list(COLOURS)))
    question = {k: v for k, v in data.train[0].items() if k != "images"}
    question["prompt"] = [{"role": "user", "content": QUESTION}]
    for step in range(1, max_steps + 1):
        batch = data.collate([question] * batch_size, tok)
        answer = names[torch.randint(len(names), (batch_size,), generator=gen)]
        batch[K.RESPONSE_IDS] = torch.stack([answer, torch.full_like(answer, tok.eos_token_id)], dim=1)
        batch[K.RESPONSE_MASK] = torch.ones_like(batch[K.RESPONSE_IDS])
        policy.model.train()
        log_probs, _ = policy.log_probs(batch)
        if log_probs[:, 0].mean() > answer_log_prob and log_probs[:, 1].mean() > eos_log_prob:
            return step - 1
        (-log_probs.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    raise RuntimeError(f"the warm start did not learn the answer form in {max_steps} steps")


def warm_started_policy(task: ShapesTask, seed: int, log=print, ship: bool = False, **policy_kwargs):
    """``(policy, data)``: the task's Policy after :func:`format_warm_start` (shipped for seed 0, else made once
    and cached: :mod:`rlflow.tasks.warm_start`) and its prompts."""
    from rlflow.models.policy import Policy

    processor = task.processor()
    policy = Policy(task.model(processor, seed), processor=processor, **policy_kwargs)
    data = task.data(processor, seed)

    def make() -> str:
        torch.manual_seed(seed)
        steps = format_warm_start(policy, data, seed=seed)
        return f"warm start: {steps} supervised steps on the answer's form (a colour name at random)"

    load_or_make("shapes", {"task": asdict(task), "seed": seed, "warm_start": "format-v2"}, policy.model, make, log,
                 ship=ship)
    return policy, data
