"""Shared pieces of the agent-loop tests: a replay engine and a small batch builder.

``ReplayEngine`` is a real :class:`~rlflow.rollout.engines.base.Engine` whose "model" is a function from the
conversation so far (decoded) to the next turn's text: the tests choose exactly which tool calls the model
makes, so the loop's behaviour between turns (tools, errors, limits, masks) is checked against known
trajectories. Learning, log-probs and the policy are tested with real transformers models.
"""

from rlflow.data.prompts import collate, load_rows
from rlflow.rollout.engines.base import Completion, Engine
from rlflow.rollout.single_turn import SingleTurnRollout


class ReplayEngine(Engine):
    """``script(context_text) -> str`` gives each turn; every token gets log-prob ``-(position + 1) / 10``."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.script(self.tokenizer.decode(prompt))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            reason = "stop"
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            out.append([Completion(ids, [-(i + 1) / 10 for i in range(len(ids))], reason)
                        for _ in range(params.n)])
        return out


def replay_rollout(tokenizer, script, n=1, max_new_tokens=400):
    rollout = SingleTurnRollout(ReplayEngine(tokenizer, script), n=n, max_new_tokens=max_new_tokens)
    rollout.tokenizer = tokenizer
    return rollout


def prompts(tokenizer, questions, extra_infos=None, ground_truths=None):
    rows = [{"prompt": [{"role": "user", "content": q}], "ground_truth": (ground_truths or [""] * len(questions))[i],
             "data_source": "test",
             "extra_info": (extra_infos or [None] * len(questions))[i]} for i, q in enumerate(questions)]
    return collate(load_rows(rows)[0], tokenizer)


def call(name, **arguments):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tool_caller(tokenizer, seed=0, steps=40):
    """A tiny Qwen2 taught for a few supervised steps to open each answer with a calculator call (the calls it then
    writes are often malformed: either way tool messages follow and responses get interior spans of tool tokens)."""
    import random

    import torch

    from rlflow.models.tiny import tiny_qwen2
    from rlflow.rollout.agent import ChatFormat
    from rlflow.tasks.calculator import CalculatorTask, demonstration, padded

    task = CalculatorTask()
    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       max_positions=256, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       seed=seed)
    chat, rows, rng = ChatFormat(tokenizer, [t.schema for t in task.tools()]), task.splits()[0][:256], random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        ids, labels, attn = padded([demonstration(chat, rng.choice(rows), True) for _ in range(16)],
                                   tokenizer.pad_token_id)
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()
