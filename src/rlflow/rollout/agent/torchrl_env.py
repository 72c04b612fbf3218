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

Transforms that read more of the data row than the prompt (TorchRL's ``GSM8KRewardParser`` reads the
row's ``answer``) get it through ``reset_data``; the adapter carries those keys from step to step.

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
        reset_data: ``row -> {key: value}`` added to the reset TensorDict besides the query, for transforms
            that read more of the data row (``row`` has ``ground_truth``, ``data_source``, ``extra_info``;
            e.g. ``lambda row: {"answer": row["extra_info"]["answer"]}`` for TorchRL's ``GSM8KRewardParser``).
        reward_key: where the environment writes a step's reward.
    """

    def __init__(self, make_env: Callable[[], Any], reset_data: Callable[[dict], dict] | None = None,
                 reward_key=("next", "reward")):
        self.make_env, self.reset_data, self.reward_key = make_env, reset_data, reward_key

    async def reset(self, trajectory) -> _EnvState:
        extra = self.reset_data(trajectory.row) if self.reset_data is not None else {}
        return await asyncio.to_thread(self._reset, list(trajectory.messages), extra)

    async def step(self, state: _EnvState, text: str) -> tuple[list[dict], float | None, bool]:
        return await asyncio.to_thread(self._step, state, text)

    async def close(self, state: _EnvState) -> None:
        if state is not None and hasattr(state.env, "close"):
            await asyncio.to_thread(_close, state.env)

    # ------------------------------------------------------------------ TorchRL calls (on worker threads)
    def _reset(self, messages: list[dict], extra: dict) -> _EnvState:
        from tensordict import NonTensorStack, TensorDict
        from torchrl.data.llm import History

        env = self.make_env()
        if extra:  # transforms read these on every step: carry them from each state into the next one
            env = _with_carried_keys(env, tuple(extra))
        base = getattr(env, "base_env", env)
        if getattr(base, "input_mode", "history") != "history":
            raise ValueError(f"TorchRLEnvironment needs a ChatEnv in history mode, got input_mode={base.input_mode!r}")
        if tuple(env.batch_size) != (1,):
            raise ValueError(f"make_env must return an environment of batch size (1,), got {tuple(env.batch_size)}")
        query = History.from_chats([[{"role": m["role"], "content": m["content"]} for m in messages]])
        data = TensorDict({base.data_key: query}, batch_size=(1,))
        for key, value in extra.items():
            data.set(key, value if hasattr(value, "shape") else NonTensorStack(value))  # one row, as a loader gives
        td = env.reset(data)
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


def _with_carried_keys(env, keys: tuple[str, ...]):
    """``env`` with a first transform that copies ``keys`` from each state into the next one.

    A TorchRL dataset environment gets this from its ``DataLoadingPrimer``; here the data row comes from rlflow,
    and ``TensorDictPrimer`` cannot hold non-tensor values (a GSM8K answer string) in this TorchRL version.
    """
    from torchrl.envs import Transform, TransformedEnv

    class CarryKeys(Transform):
        def _step(self, tensordict, next_tensordict):
            for key in keys:
                if key in tensordict.keys() and key not in next_tensordict.keys():
                    next_tensordict.set(key, tensordict.get(key))
            return next_tensordict

        def _reset(self, tensordict, tensordict_reset):
            return tensordict_reset

    if isinstance(env, TransformedEnv):
        env.insert_transform(0, CarryKeys())
        return env
    return TransformedEnv(env, CarryKeys())


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
