"""Token ids of prompts and of the messages appended between model turns, through the tokenizer's chat template.

The model's own tokens are never re-tokenized: a trajectory is the prompt's ids, then each turn's sampled
ids, then the ids of the tool/user messages that follow, and so on. Those appended ids come from the chat
template (``apply_chat_template(messages, tools=...)``), as the difference between the rendering of a fixed
two-message conversation with and without the new messages::

    base  = render([user ".", assistant "."])                       # ... "<|im_end|>\\n"
    ext   = render([user ".", assistant "."] + new, gen. prompt)   # ... "<|im_end|>\\n<|im_start|>user\\n..."
    delta = ext[len(base):]

plus what the template puts right after an assistant message's end-of-turn token (``"\\n"`` for ChatML),
which the model's turn (ending *at* that token) lacks. The trajectory therefore equals the chat template's
rendering of the whole conversation (tested), which is what the policy was trained on and what serving sees.
"""

from __future__ import annotations

from functools import lru_cache


class ChatFormat:
    """Renders prompts and inter-turn messages of one tokenizer (and tool list) as token ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: OpenAI function schemas shown to the model (``apply_chat_template(..., tools=tools)``).
        template_kwargs: more keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``).
    """

    _BASE = ({"role": "user", "content": "."}, {"role": "assistant", "content": "."})

    def __init__(self, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent loop renders tool and user messages with the tokenizer's chat template, and "
                             "this tokenizer has none: set tokenizer.chat_template (verl: "
                             "actor_rollout_ref.model.custom_chat_template)")
        self.tokenizer = tokenizer
        self.tools = list(tools or []) or None
        self.template_kwargs = dict(template_kwargs or {})
        self._after_end = lru_cache(maxsize=64)(self._after_end_uncached)
        self._base: list[int] | None = None

    @property
    def base_ids(self) -> list[int]:
        """The fixed two-message conversation every appended rendering is measured against (computed once)."""
        if self._base is None:
            self._base = self.encode(self.render(self._BASE, add_generation_prompt=False))
        return self._base

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """A prompt's ids: chat messages are rendered with the tools and the generation prompt; a string is taken
        as already formatted."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.encode(self.render(prompt, add_generation_prompt=True))

    def _after_end_uncached(self, end_token: int) -> tuple[int, ...]:
        base = self.base_ids
        where = [i for i, t in enumerate(base) if t == end_token]
        return tuple(base[where[-1] + 1:]) if where else ()

    def append_ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        """Ids to append after a model turn that ended with ``last_token``: the template's tail after that
        end-of-turn token, the ``messages`` (tool results, a user turn) and the next generation prompt."""
        base = self.base_ids
        ext = self.encode(self.render([*self._BASE, *messages], add_generation_prompt=True))
        if ext[: len(base)] != base:
            raise ValueError("the chat template renders a conversation differently once messages are appended (its "
                             "earlier part changes), so turns cannot be appended token by token; use a template "
                             "whose rendering of earlier messages does not depend on later ones")
        tail = list(self._after_end(last_token)) if last_token is not None else []
        return tail + ext[len(base):]
