"""TorchRL LLM environments in the agent loop: a ``ChatEnv`` with its transforms answers the model's turns.

TorchRL's ``torchrl.envs.llm.ChatEnv`` (history mode) keeps a conversation as a ``History``; transforms
appended to it act on each step: ``PythonInterpreter`` runs the model's Python code blocks and appends the
output as a ``tool`` message, ``ExecuteToolsInOrder``/``SimpleToolTransform``/``MCPToolTransform`` run tool
calls, reward transforms write ``("next", "reward")``. ``TorchRLEnvironment(make_env)`` lets rlflow's
:class:`~rlflow.rollout.agent.AgentLoop` drive such an environment in place of rlflow's tools::

    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import PythonInterpreter

    env = TorchRLEnvironment(lambda: ChatEnv(batch_size=(1,)).append_transform(PythonInterpreter()))
    rollout = AgentLoop(HFRollout(n=8, max_new_tokens=512), environment=env, max_assistant_turns=4)

Per trajectory the adapter makes one environment (batch size 1), resets it with the prompt's messages, and
after each model turn steps it with ``history.full = prompt + {"role": "assistant", "content": turn}``.
The messages the transforms appended become the next tokens of the trajectory, rendered by rlflow's chat
template (mask 0, like tool results); ``("next", "reward")`` is summed into ``step_rewards`` and
``("next", "done")`` ends the conversation. A turn after which no transform appended anything ends it too.

The model's tokens stay rlflow's: the environment sees text (its history), the trajectory keeps the
sampled token ids. A ``system_prompt`` set on the ``ChatEnv`` is seen by the environment's transforms but
is not part of the model's prompt (put it in the data's chat messages for the model to see it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _EnvState:
    env: Any
    td: Any  # the environment's current state (its history's prompt is the conversation so far)


class TorchRLEnvironment:
    """Adapter from a TorchRL chat environment factory to the agent loop's between-turn interface.

    Args:
        make_env: returns a fresh environment of batch size ``(1,)`` in history mode (a ``ChatEnv`` with
            transforms, or a ``TransformedEnv`` around one); called once per trajectory.
        reward_key: where the environment writes a step's reward.
    """

    def __init__(self, make_env: Callable[[], Any], reward_key=("next", "reward")):
        self.make_env, self.reward_key = make_env, reward_key

    async def reset(self, trajectory) -> _EnvState:
        return await asyncio.to_thread(self._reset, list(trajectory.messages))

    async def step(self, state: _EnvState, text: str) -> tuple[list[dict], float | None, bool]:
        return await asyncio.to_thread(self._step, state, text)

    async def close(self, state: _EnvState) -> None:
        if state is not None and hasattr(state.env, "close"):
            await asyncio.to_thread(_close, state.env)

    # ------------------------------------------------------------------ TorchRL calls (on worker threads)
    def _reset(self, messages: list[dict]) -> _EnvState:
        from tensordict import TensorDict
        from torchrl.data.llm import History

        env = self.make_env()
        base = getattr(env, "base_env", env)
        if getattr(base, "input_mode", "history") != "history":
            raise ValueError(f"TorchRLEnvironment needs a ChatEnv in history mode, got input_mode={base.input_mode!r}")
        if tuple(env.batch_size) != (1,):
            raise ValueError(f"make_env must return an environment of batch size (1,), got {tuple(env.batch_size)}")
        query = History.from_chats([[{"role": m["role"], "content": m["content"]} for m in messages]])
        td = env.reset(TensorDict({base.data_key: query}, batch_size=(1,)))
        return _EnvState(env, td)

    def _step(self, state: _EnvState, text: str) -> tuple[list[dict], float | None, bool]:
        from torchrl.data.llm import History
        from torchrl.modules.llm.policies.common import ChatHistory

        prompt = state.td["history"].prompt
        response = History.from_chats([[{"role": "assistant", "content": text}]])
        full = prompt.extend(response, inplace=False, dim=-1)
        state.td["history"] = ChatHistory(prompt=prompt, response=response, full=full)
        out = state.env.step(state.td)
        nxt = out["next"]
        history = _messages(nxt["history"].prompt)
        new = [m for m in history[len(_messages(full)):] if m["role"] != "<none>"]  # "<none>": TorchRL's padding
        reward = out.get(self.reward_key, None)
        done = out.get(("next", "done"), None)
        state.td = state.env.step_mdp(out) if hasattr(state.env, "step_mdp") else nxt
        return (new, None if reward is None else float(reward.sum()),
                bool(done.any()) if done is not None else False)


def _messages(history) -> list[dict]:
    """The one conversation of a batch-size-1 ``History`` as chat messages."""
    chats = history.unbind(0)[0] if history.batch_dims > 1 else history
    roles, contents = chats.role, chats.content
    roles = roles if isinstance(roles, list) else list(roles)
    contents = contents if isinstance(contents, list) else list(contents)
    return [{"role": str(r), "content": str(c)} for r, c in zip(roles, contents)]


def _close(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - an environment that cannot close twice must not fail the rollout
        pass
