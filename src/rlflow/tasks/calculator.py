"""The built-in tool-use task: two-digit multiplication that the model can only get right with a calculator.

``user: 47*82`` -> the model calls ``<tool_call>{"name":"calc","arguments":{"expr":"47*82"}}</tool_call>``,
reads ``3854`` in the tool message, and answers ``=3854``. A 0.6M-parameter char-level Qwen2 does not learn to
multiply in minutes, but it learns to copy: the answer needs the tool.

The tokenizer is the char tokenizer plus ChatML's ``<|im_start|>``/``<|im_end|>`` and Hermes'
``<tool_call>``/``</tool_call>`` tokens, and, as BPE vocabularies have them, whole-word tokens for the role
names and the tool-call keys; a small chat template lists the tools (``apply_chat_template(messages,
tools=...)``) and renders ``tool`` messages: the path real models take.

A short supervised warm start (cached, like the default job's) teaches the format on demonstrations that
call the tool only ``tool_fraction`` of the time and otherwise answer directly (``=`` and a number the
model cannot compute): the first token decides, ``=`` is the likelier one, so greedy decoding answers
directly and held-out accuracy starts near 0 while samples call the tool ``tool_fraction`` of the time.
GRPO learns that calling pays and raises it (``rlflow train --task tools``; figures in docs/multi-turn.md).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import asdict, dataclass

import torch

from rlflow.data.prompts import PromptData
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout.agent.chat import ChatFormat
from rlflow.rollout.tools.calculator import Calculator
from rlflow.tasks.warm_start import load_or_make

DATA_SOURCE = "rlflow/calculator"
WORDS = ("system", "user", "assistant", "tool", '"name"', '"arguments"', "calc", "expr")
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# ChatML, compact: the tools are listed by name and required arguments, tool results get their own role.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.required | join(',') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer():
    """Char tokenizer over printable ASCII and newline, with ChatML and Hermes tool-call tokens and a chat
    template; ``<|im_end|>`` ends a turn (EOS)."""
    tok = char_tokenizer("".join(c for c in string.printable if c not in "\t\r\x0b\x0c"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([TOOL_CALL, TOOL_CALL_END])  # plain added tokens, as in Qwen2.5: kept in decoded text
    tok.add_tokens(list(WORDS))  # whole words, as a BPE vocabulary has them: shorter sequences, same text
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def calc_tool() -> Calculator:
    """The built-in :class:`Calculator` under a short schema (``calc(expr)``), as a verl tool YAML would rename it."""
    return Calculator(tool_schema={"type": "function", "function": {
        "name": "calc", "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}})


def final_answer(extra_info) -> str:
    """The model's last turn (the agent loop records the conversation in ``extra_info["messages"]``)."""
    messages = (extra_info or {}).get("messages") or []
    return next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the model's final turn is ``=`` and the product. ``solution_str`` (the whole trajectory) also
    holds the tool's output, so only the last assistant message counts: copying the tool's text into an
    answer is the skill; seeing it in the tool message is not."""
    return float(final_answer(extra_info).strip() == f"={ground_truth}")


def call_text(a: int, b: int) -> str:
    return TOOL_CALL + json.dumps({"name": "calc", "arguments": {"expr": f"{a}*{b}"}}, separators=(",", ":")) \
        + TOOL_CALL_END


@dataclass(frozen=True)
class CalculatorTask:
    """Disjoint train / warm-start-validation / held-out splits of products of ``[low, high]`` pairs (seed 1234)."""
    low: int = 10
    high: int = 99
    train_size: int = 4096
    held_out: int = 128
    warm_val: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    max_response_tokens: int = 64
    tool_fraction: float = 0.4   # share of warm-start demonstrations that call the tool

    def splits(self) -> tuple[list[dict], list[dict], list[dict]]:
        rng = random.Random(1234)
        seen, pairs = set(), []
        while len(pairs) < self.train_size + self.held_out + self.warm_val:
            pair = (rng.randint(self.low, self.high), rng.randint(self.low, self.high))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}"}], "ground_truth": str(a * b),
                 "data_source": DATA_SOURCE, "extra_info": {"a": a, "b": b}} for a, b in pairs]
        test, val = rows[: self.held_out], rows[self.held_out: self.held_out + self.warm_val]
        return rows[self.held_out + self.warm_val:], val, test

    def data(self, seed: int = 0) -> PromptData:
        train, _, test = self.splits()
        return PromptData(train, val=test, seed=seed)

    def tokenizer(self):
        return chat_tokenizer()

    def tools(self) -> list:
        return [calc_tool()]

    def model(self, seed: int):
        tok = self.tokenizer()
        return tiny_qwen2(len(tok), hidden_size=self.hidden_size, num_layers=self.num_layers,
                          intermediate_size=4 * self.hidden_size, max_positions=256, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=seed)


def demonstration(chat: ChatFormat, row: dict, use_tool: bool) -> tuple[list[int], list[int]]:
    """A supervised trajectory's ids and its loss mask (1 on what the model writes), built exactly as the agent
    loop builds trajectories: prompt with tools, the call, the tool message through the chat template, the answer."""
    tok, eos = chat.tokenizer, chat.tokenizer.eos_token_id
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    ids = chat.prompt_ids(row["prompt"])
    mask = [0] * len(ids)
    if use_tool:
        call = tok(call_text(a, b), add_special_tokens=False)["input_ids"] + [eos]
        result = chat.append_ids([{"role": "tool", "name": "calc", "content": str(a * b)}], eos)
        ids, mask = ids + call + result, mask + [1] * len(call) + [0] * len(result)
    answer = tok(f"={a * b}", add_special_tokens=False)["input_ids"] + [eos]
    return ids + answer, mask + [1] * len(answer)


def padded(seqs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), T), pad)
    labels = torch.full((len(seqs), T), -100)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for row, (s, m) in enumerate(seqs):
        ids[row, : len(s)], attn[row, : len(s)] = torch.tensor(s), 1
        labels[row, : len(s)] = torch.where(torch.tensor(m).bool(), torch.tensor(s), -100)
    return ids, labels, attn


@torch.no_grad()
def format_accuracy(model, chat: ChatFormat, rows: list[dict]) -> float:
    """Share of ``rows`` whose whole tool-using trajectory greedy decoding reproduces once the first token (the
    call) is given: every later written token is the argmax under teacher forcing."""
    ids, labels, attn = padded([demonstration(chat, r, True) for r in rows], chat.tokenizer.pad_token_id)
    model.eval()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    target, right = labels[:, 1:], None
    first = (target != -100).long().argmax(-1)  # the decision token is chosen by sampling, not checked here
    target = target.clone()
    target[torch.arange(len(rows)), first] = -100
    right = (logits.argmax(-1) == target) | (target == -100)
    return right.all(-1).float().mean().item()


def supervised_warm_start(model, task: CalculatorTask, train: list[dict], val: list[dict], *, target: float = 0.9,
                          lr: float = 3e-3, batch_size: int = 32, max_steps: int = 2000, eval_every: int = 25,
                          seed: int = 0) -> int:
    """Train on written tokens only until :func:`format_accuracy` on ``val`` reaches ``target``; returns the steps.

    Raises:
        RuntimeError: if ``target`` is not reached within ``max_steps``.
    """
    chat = ChatFormat(task.tokenizer(), [t.schema for t in task.tools()])
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(1, max_steps + 1):
        idx = torch.randint(len(train), (batch_size,), generator=gen).tolist()
        ids, labels, attn = padded([demonstration(chat, train[i], rng.random() < task.tool_fraction) for i in idx],
                                   chat.tokenizer.pad_token_id)
        model.train()
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % eval_every == 0 and format_accuracy(model, chat, val) >= target:
            return step
    raise RuntimeError(f"warm start did not reach format accuracy {target} in {max_steps} steps")


def warm_started_model(task: CalculatorTask, seed: int, target: float = 0.9, log=print, ship: bool = False):
    """The task's model after the supervised warm start (shipped for seed 0, else made once and cached:
    :mod:`rlflow.tasks.warm_start`)."""
    model, tok = task.model(seed), task.tokenizer()

    def make() -> str:
        train, val, _ = task.splits()
        torch.manual_seed(seed)
        steps = supervised_warm_start(model, task, train, val, target=target, seed=seed)
        return f"warm start: {steps} supervised steps to format accuracy >= {target}"

    load_or_make("calculator", {"task": asdict(task), "seed": seed, "target": target, "template": CHAT_TEMPLATE},
                 model, make, log, ship=ship)
    return model, tok
