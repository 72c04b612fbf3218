"""AgentLoop: multi-turn rollouts with tool calls, over any engine.

Each sample is a conversation: the model writes a turn; the tool calls in it (Hermes ``<tool_call>`` JSON,
or any :class:`~rlflow.rollout.tools.parsers.ToolParser`) run concurrently, and their results are appended
as ``tool`` messages through the tokenizer's chat template; without a call an :class:`Interaction` (a
simulated user) may answer, or a TorchRL environment steps; and so on until the model answers, a turn
limit is reached, or the response-token budget is spent. The whole conversation after the prompt is one
response::

    response_ids   [ model turn 1 | tool result | model turn 2 | user reply | model turn 3 ] pad
    response_mask  [ 1 1 1 1 1 1  | 0 0 0 0 0 0 | 1 1 1 1 1 1  | 0 0 0 0 0  | 1 1 1 1 1 1  ] 0
    rollout_log_probs: the sampler's log-probs on model tokens, 0 elsewhere

so the estimators and losses, which read only masked tokens, train on what the model wrote and nothing
else, and the policy recomputes log-probs on the same concatenated sequence the sampler saw.

The loop is written once over :class:`~rlflow.rollout.engines.base.Engine`: it wraps a single-turn rollout
(``HFRollout``, ``VLLMRollout``, ``ServerRollout``, ...) for its engine, sampling options, weight sync and
``n``, and only changes what happens between turns.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time

import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import column
from rlflow.rollout.agent.batching import DirectRequests, TurnBatcher, run_sync
from rlflow.rollout.agent.chat import ChatFormat
from rlflow.rollout.agent.interaction import Interaction
from rlflow.rollout.agent.named import NamedLoops
from rlflow.rollout.agent.trajectory import Trajectory, summarize
from rlflow.rollout.single_turn import SingleTurnRollout, unpadded
from rlflow.rollout.tools.base import Tool, ToolError, ToolResult
from rlflow.rollout.tools.config import load_interaction_config, load_tool_config
from rlflow.rollout.tools.parsers import ToolCall, tool_parser
from rlflow.rollout.wrapper import RolloutWrapper

TRUNCATE_SIDES = ("left", "right", "middle")
VERL_TOOL_KWARGS = {"create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs"}


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's rule: ``left`` keeps the first ``limit`` characters, ``right`` the last, ``middle`` both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


class AgentLoop(RolloutWrapper):
    """Multi-turn tool-calling rollout around a single-turn ``rollout`` (its engine and sampling options).

    Args:
        rollout: the single-turn rollout whose engine samples each turn (its ``n``, temperature, top-p/k,
            seed apply per sample; its ``max_new_tokens`` is the default response budget).
        tools: :class:`~rlflow.rollout.tools.Tool` objects, or a verl tool YAML path.
        format: the tool-call format the model writes: ``"hermes"``, ``"vllm:<name>"`` (one of vLLM's tool
            parsers, e.g. ``vllm:llama3_json``) or a ``ToolParser``.
        interaction: an :class:`Interaction`, a ``{name: Interaction}`` dict (rows choose with
            ``interaction_kwargs.name``) or a verl interaction YAML path; asked for a user turn when the
            model calls no tool.
        environment: a TorchRL environment adapter (:class:`~rlflow.rollout.agent.torchrl_env.TorchRLEnvironment`)
            that answers each model turn instead of rlflow's tools and interaction.
        max_assistant_turns, max_user_turns: turn limits (``None``: none but the budget); user turns count
            tool-result turns and interaction turns, as verl counts them.
        max_parallel_calls: calls run per turn (later ones are dropped and counted).
        max_tool_response_length, tool_response_truncate_side: tool text is cut to this many characters
            (``left`` keeps the start, ``right`` the end, ``middle`` both ends, as verl).
        max_response_tokens: the response budget (model + appended tokens); default ``rollout.max_new_tokens``.
        tool_timeout_s: overrides every tool's own ``timeout_s``.
        concurrent_requests: send each turn to the engine on its own (servers) instead of batching turns.
        template_kwargs: extra ``apply_chat_template`` arguments.
        name, agents: verl's per-row choice of loop. A batch row whose ``agent_name`` column (rlflow.data reads
            it from the data) names one of ``agents`` (``{name: factory}``, ``factory(rollout)`` making an
            ``AgentLoop``, e.g. ``functools.partial(MyLoop, tools=...)``) runs with that loop, over this loop's
            rollout; a row naming ``name`` or none runs with this loop; another name is an error naming the
            row and the names. All conversations of a batch share one engine (their turns batched together)
            and come back in the batch's order.

    Writes the single-turn keys (``response_*``, ``rollout_log_probs``, ``group``, ``response_text``: the
    decoded trajectory, tool results included), the prompts it rendered with the tools (``prompt_ids``,
    ``prompt_mask``), ``num_turns`` and ``step_rewards`` (summed tool rewards and turn scores), and adds the
    conversation to each row's ``extra_info`` (``messages``, ``num_turns``, ``tool_calls``,
    ``rollout_reward_scores``, ``finish_reason``) for reward functions. ``stats`` holds the metrics.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP,
                K.RESPONSE_TEXT, K.NUM_TURNS, K.STEP_REWARDS)

    def __init__(self, rollout, tools=(), *, format: str = "hermes", interaction=None, environment=None,
                 max_assistant_turns: int | None = None, max_user_turns: int | None = None,
                 max_parallel_calls: int = 1, max_tool_response_length: int = 256,
                 tool_response_truncate_side: str = "middle", max_response_tokens: int | None = None,
                 tool_timeout_s: float | None = None, concurrent_requests: bool = False,
                 template_kwargs: dict | None = None, name: str | None = None, agents: dict | None = None):
        if isinstance(tools, (str, bytes)) or hasattr(tools, "__fspath__"):
            tools = load_tool_config(tools)
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                raise TypeError(f"tools must be rlflow.rollout.tools.Tool objects, got {type(tool).__name__}")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        if isinstance(interaction, (str, bytes)) or hasattr(interaction, "__fspath__"):
            interaction = load_interaction_config(interaction)
        if interaction is not None and not isinstance(interaction, (Interaction, dict)):
            raise TypeError(f"interaction must be an Interaction, a {{name: Interaction}} dict or a YAML path, "
                            f"got {type(interaction).__name__}")
        for arg, value, low in (("max_assistant_turns", max_assistant_turns, 1), ("max_user_turns", max_user_turns, 0),
                                ("max_parallel_calls", max_parallel_calls, 1),
                                ("max_tool_response_length", max_tool_response_length, 1),
                                ("max_response_tokens", max_response_tokens, 1)):
            if value is not None and value < low:
                raise ValueError(f"{arg} must be >= {low} (or None), got {value}")
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, "
                             f"got {tool_response_truncate_side!r}")
        if tool_timeout_s is not None and tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        if not isinstance(rollout, SingleTurnRollout):
            raise TypeError(f"AgentLoop samples each turn with a single-turn rollout's engine (HFRollout, VLLMRollout, "
                            f"ServerRollout, SingleTurnRollout): {type(rollout).__name__} is not one")
        super().__init__(rollout)
        self.in_keys, self.out_keys = type(self).in_keys, type(self).out_keys
        self.parser = tool_parser(format)
        self.interaction, self.environment = interaction, environment
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls, self.max_tool_response_length = max_parallel_calls, max_tool_response_length
        self.truncate_side, self.tool_timeout_s = tool_response_truncate_side, tool_timeout_s
        self.max_response_tokens, self.concurrent_requests = max_response_tokens, concurrent_requests
        self.template_kwargs = dict(template_kwargs or {})
        self.stats: dict[str, float] = {}
        self._chat: ChatFormat | None = None
        self.named = NamedLoops(name, agents)

    # ------------------------------------------------------------------ what the Trainer asks of a rollout
    # (bind, sync_weights, n, temperature, tokenizer, holds_own_weights: RolloutWrapper's, to the wrapped rollout)
    def bind(self, model, tokenizer) -> None:
        super().bind(model, tokenizer)
        self._chat = None

    def with_options(self, **overrides) -> "AgentLoop":
        """A copy sampling with other options (validation), running the same loop."""
        clone = copy.copy(self)
        clone.rollout = self.rollout.with_options(**overrides)
        return clone

    @property
    def max_new_tokens(self) -> int:
        """The response budget (all turns together), which the Trainer's length metrics use."""
        return self.max_response_tokens or self.rollout.max_new_tokens

    @property
    def chat(self) -> ChatFormat:
        if self._chat is None or self._chat.tokenizer is not self.tokenizer:
            schemas = [t.schema for t in self.tools.values()]
            self._chat = ChatFormat(self.tokenizer, schemas, self.template_kwargs)
            self.parser.bind(self.tokenizer, schemas)  # vLLM's parsers read the special tokens and the tools
        return self._chat

    # ------------------------------------------------------------------ the rollout
    def forward(self, batch: TensorDict) -> TensorDict:
        self.rollout.resync()  # a shared engine loaded another model's weights since
        trajs = self.trajectories(batch)
        run_sync(self.run(trajs))
        return self.laid_out(batch, trajs)

    def trajectories(self, batch: TensorDict) -> list[Trajectory]:
        """The starting states of ``batch``'s samples, ``n`` per prompt in the order of its rows."""
        if self.rollout.tokenizer is None:
            raise RuntimeError("AgentLoop has no engine: call rollout.bind(model, tokenizer) (the Trainer does)")
        num_prompts = batch.batch_size[0]
        names = _column(batch, K.AGENT_NAME, num_prompts)
        loops = [self.loop_for(name, f"batch row {i}" + (f" (data row {index})" if index is not None else ""))
                 for i, (name, index) in enumerate(zip(names, _column(batch, K.ROW_INDEX, num_prompts)))]
        for loop in {id(loop): loop for loop in loops}.values():
            if loop.tools or loop.interaction is not None or loop.environment is not None:
                loop.chat  # fails now, naming the fix, when the tokenizer has no chat template to render turns with
        given, raw = unpadded(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]), _column(batch, K.RAW_PROMPT, num_prompts)
        rows = [{"ground_truth": g, "data_source": d, "extra_info": e} for g, d, e in zip(
            _column(batch, K.GROUND_TRUTH, num_prompts), _column(batch, K.DATA_SOURCE, num_prompts),
            _column(batch, K.EXTRA_INFO, num_prompts))]
        out = []
        for i, loop in enumerate(loops):
            prompt = loop.prompt_for(given[i], raw[i])
            for _ in range(self.n):
                t = loop.new_trajectory(prompt, raw[i], rows[i])
                t.agent_name = names[i]
                out.append(t)
        return out

    def laid_out(self, batch: TensorDict, trajs: list[Trajectory]) -> TensorDict:
        """``batch``'s rows, ``n`` each, with the finished ``trajs`` (of :meth:`trajectories`) written in; the
        metrics go to ``stats``."""
        n, num_prompts, device = self.n, batch.batch_size[0], batch[K.PROMPT_IDS].device
        extra = _column(batch, K.EXTRA_INFO, num_prompts)
        out = batch.repeat_interleave(n, dim=0) if n > 1 else batch.clone(False)
        self.write(out, trajs, [extra[i] for i in range(num_prompts) for _ in range(n)], device)
        out[K.GROUP] = torch.arange(num_prompts, device=device).repeat_interleave(n)
        self.stats = summarize(trajs)
        return out

    def prompt_for(self, given: list[int], raw_prompt) -> list[int]:
        """A chat prompt (``raw_prompt``) re-rendered with this loop's tool schemas; another as the data gave it."""
        if isinstance(raw_prompt, list) and getattr(self.tokenizer, "chat_template", None):
            return self.chat.prompt_ids(raw_prompt)
        return given

    def new_trajectory(self, prompt: list[int], raw_prompt, row: dict) -> Trajectory:
        """A sample's starting state: its prompt, the conversation so far, its ``tools_kwargs``/``interaction_kwargs``
        (from ``row["extra_info"]``) and its data ``row``."""
        extra_info = row["extra_info"] if isinstance(row.get("extra_info"), dict) else {}
        messages = ([dict(m) for m in raw_prompt] if isinstance(raw_prompt, list)
                    else [{"role": "user", "content": raw_prompt}] if isinstance(raw_prompt, str) else [])
        return Trajectory(prompt, self.max_new_tokens, tools_kwargs=dict(extra_info.get("tools_kwargs") or {}),
                          interaction_kwargs=dict(extra_info.get("interaction_kwargs") or {}), messages=messages,
                          row=row)

    async def run(self, trajs: list[Trajectory]) -> None:
        engine, params = self.rollout.engine, self.rollout.sampling
        sampler = DirectRequests(engine, params) if self.concurrent_requests else TurnBatcher(engine, params, len(trajs))
        await asyncio.gather(*(self.loop_for(t.agent_name).run_one(t, sampler) for t in trajs))

    def loop_for(self, agent_name: str | None, where: str = "") -> "AgentLoop":
        """The loop that runs a row naming ``agent_name`` (verl's per-row choice: this loop for none or its
        ``name``, else one of ``agents``); an unknown name is an error naming the row (``where``) and the names."""
        return self.named.loop(self, agent_name, where, AgentLoop)

    async def run_one(self, t: Trajectory, sampler) -> None:
        """One conversation: model turn, then tools / user / environment, until a stop condition."""
        session = None
        try:
            session = await self.start(t)
            while True:
                start = time.perf_counter()
                turn = await sampler.generate(t.context, t.remaining)
                t.gen_s += time.perf_counter() - start
                t.add_model_turn(turn.token_ids, turn.log_probs, turn.extras.get("token_versions"))
                text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
                t.messages.append({"role": "assistant", "content": text})
                if turn.finish_reason == "length" or t.remaining <= 0:
                    t.finish = "length"
                    break
                calls = self.parser.parse(text)[1] if self.tools and self.environment is None else []
                limit = self.turn_limit(t)
                if limit is not None:  # a plain answer at the limit still counts as an answer
                    t.finish = limit if calls or self.environment is not None or self.interaction_for(t) else "answer"
                    break
                start = time.perf_counter()
                messages, finish = await self.respond(t, text, calls, session)
                t.tool_s += time.perf_counter() - start
                if messages:
                    fits = t.add_observation(self.chat.append_ids(messages, turn.token_ids[-1] if turn.token_ids else None))
                    if fits:
                        t.messages += messages
                        t.user_turns += 1
                    if not fits or t.remaining <= 0:  # no room left for another model token
                        t.finish = "length"
                        break
                if finish:
                    t.finish = finish
                    break
        finally:
            sampler.retire()  # first: the others' turns never wait for a trajectory that has ended
            if session is not None:
                await self.finish(t, session)

    # ------------------------------------------------------------------ between turns
    async def start(self, t: Trajectory):
        """Per-trajectory state: the interaction instance or the environment's state."""
        if self.environment is not None:
            return await self.environment.reset(t)
        interaction = self.interaction_for(t)
        if interaction is not None:
            return await interaction.start_interaction(None, **t.interaction_kwargs)
        return None

    async def finish(self, t: Trajectory, session) -> None:
        if self.environment is not None:
            await self.environment.close(session)
        elif (interaction := self.interaction_for(t)) is not None:
            await interaction.finalize_interaction(session, **t.interaction_kwargs)

    def interaction_for(self, t: Trajectory) -> Interaction | None:
        if self.interaction is None or isinstance(self.interaction, Interaction):
            return self.interaction
        name = t.interaction_kwargs.get("name")
        if name is None and len(self.interaction) == 1:
            return next(iter(self.interaction.values()))
        if name not in self.interaction:
            raise KeyError(f"extra_info.interaction_kwargs.name={name!r}: no such interaction; "
                           f"configured: {sorted(self.interaction)}")
        return self.interaction[name]

    def turn_limit(self, t: Trajectory) -> str | None:
        """The turn limit ``t`` has reached, if any."""
        if self.max_assistant_turns is not None and t.assistant_turns >= self.max_assistant_turns:
            return "max_assistant_turns"
        if self.max_user_turns is not None and t.user_turns >= self.max_user_turns:
            return "max_user_turns"
        return None

    async def respond(self, t: Trajectory, text: str, calls: list[ToolCall], session) -> tuple[list[dict], str | None]:
        """The messages that answer the model's turn (its parsed ``calls``), and a finish reason when it ends."""
        if self.environment is not None:
            messages, reward, done = await self.environment.step(session, text)
            if reward is not None:
                t.turn_scores.append(float(reward))
            return messages, ("environment" if done else None if messages else "answer")
        if calls:
            run, t.dropped_calls = calls[: self.max_parallel_calls], t.dropped_calls + max(0, len(calls) - self.max_parallel_calls)
            results = await asyncio.gather(*(self.call_tool(t, c) for c in run))
            return [{"role": "tool", "name": c.name, "content": r.text} for c, r in zip(run, results)], None
        interaction = self.interaction_for(t)
        if interaction is None:
            return [], "answer"
        stop, reply, reward, _ = await interaction.generate_response(session, t.messages, **t.interaction_kwargs)
        if reward is not None:
            t.turn_scores.append(float(reward))
        return [{"role": "user", "content": str(reply)}], ("interaction" if stop else None)

    async def call_tool(self, t: Trajectory, call: ToolCall) -> ToolResult:
        """Run one call; any failure becomes an error message for the model, counted, never raised."""
        t.tool_calls += 1
        tool = self.tools.get(call.name)
        if call.error is not None:
            kind, result = "parse", ToolResult(f"Error: {call.error}")
        elif tool is None:
            kind, result = "unknown_tool", ToolResult(f"Error: there is no tool {call.name!r}; available: "
                                                      f"{', '.join(self.tools) or 'none'}")
        else:
            kind, result = await self._execute(t, tool, call)
        if kind is not None:
            t.call_errors[kind] += 1
            result.error = kind
        if result.reward is not None:
            t.tool_rewards.append(float(result.reward))
        for key, value in result.metrics.items():
            if isinstance(value, (int, float)):
                t.tool_metrics.setdefault(f"{call.name}/{key}", []).append(float(value))
        cut = truncate_text(result.text, self.max_tool_response_length, self.truncate_side)
        t.truncated_results += cut != result.text
        result.text = cut
        return result

    async def _execute(self, t: Trajectory, tool: Tool, call: ToolCall) -> tuple[str | None, ToolResult]:
        kwargs = t.tools_kwargs.get(tool.name) or {}
        if set(kwargs) <= VERL_TOOL_KWARGS:  # verl's {create_kwargs: {...}, execute_kwargs: {...}}
            kwargs = {**kwargs.get("create_kwargs", {}), **kwargs.get("execute_kwargs", {})}
        timeout = self.tool_timeout_s or tool.timeout_s
        try:
            result = await asyncio.wait_for(tool(call.arguments, session=t.sessions.setdefault(tool.name, {}),
                                                 **kwargs), timeout)
            return None, result
        except (asyncio.TimeoutError, TimeoutError):
            return "timeout", ToolResult(f"Error: {tool.name} timed out after {timeout:g} s")
        except ToolError as e:
            return "error", ToolResult(f"Error: {e}")
        except Exception as e:  # noqa: BLE001 - a failing tool is data for the model, never a crashed step
            detail = json.dumps(str(e))[1:-1][:500]
            return "error", ToolResult(f"Error: {tool.name} raised {type(e).__name__}: {detail}")

    # ------------------------------------------------------------------ output
    def write(self, out: TensorDict, trajs: list[Trajectory], extra: list, device) -> None:
        pad, N = self.tokenizer.pad_token_id, len(trajs)
        P = max(len(t.prompt_ids) for t in trajs)
        R = max(1, max(len(t.response_ids) for t in trajs))
        prompt_ids, prompt_mask = torch.full((N, P), pad, dtype=torch.long), torch.zeros((N, P), dtype=torch.long)
        response, mask = torch.full((N, R), pad, dtype=torch.long), torch.zeros((N, R), dtype=torch.long)
        log_probs = torch.zeros((N, R), dtype=torch.float32)
        for row, t in enumerate(trajs):
            p, r = len(t.prompt_ids), len(t.response_ids)
            prompt_ids[row, P - p:], prompt_mask[row, P - p:] = torch.tensor(t.prompt_ids), 1
            if r:
                response[row, :r] = torch.tensor(t.response_ids)
                mask[row, :r] = torch.tensor(t.response_mask)
                log_probs[row, :r] = torch.tensor(t.log_probs, dtype=torch.float32)
        out[K.PROMPT_IDS], out[K.PROMPT_MASK] = prompt_ids.to(device), prompt_mask.to(device)
        out[K.PROMPT_TEXT] = NonTensorStack(*[self.tokenizer.decode(t.prompt_ids) for t in trajs])  # as rendered
        out[K.RESPONSE_IDS], out[K.RESPONSE_MASK] = response.to(device), mask.to(device)
        out[K.ROLLOUT_LOG_PROBS] = log_probs.to(device)
        out[K.NUM_TURNS] = torch.tensor([t.num_turns for t in trajs], device=device)
        out[K.STEP_REWARDS] = torch.tensor([t.step_reward for t in trajs], dtype=torch.float32, device=device)
        texts = [self.tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
        out[K.RESPONSE_TEXT] = NonTensorStack(*texts)
        out[K.EXTRA_INFO] = NonTensorStack(*[{**(e if isinstance(e, dict) else {}), **t.info()}
                                             for e, t in zip(extra, trajs)])


def _column(batch: TensorDict, key: str, size: int) -> list:
    if key not in batch.keys():
        return [None] * size
    return column(batch, key)
