"""A custom agent loop for verl's ``actor_rollout_ref.rollout.agent.agent_loop_config_path``.

verl's agent loops subclass its ``AgentLoopBase`` and talk to its server manager; rlflow's subclass
``rlflow.rollout.agent.AgentLoop`` and override ``run_one(t, sampler)`` (one conversation) or the between-turn
hook ``respond(t, text, calls, session)``. ``agent_loops.yaml`` next to this file lists it as verl's file would::

    - name: think_twice
      _target_: examples/agent_loop/think_twice.py:ThinkTwice
      draft_tokens: 4

and ``actor_rollout_ref.rollout.agent.default_agent_loop=think_twice`` selects it. See docs/multi-turn.md,
"Custom agent loops".
"""

from rlflow.rollout.agent import AgentLoop


class ThinkTwice(AgentLoop):
    """A short draft (at most ``draft_tokens``), the user's ``nudge``, then the final answer: two model turns."""

    def __init__(self, rollout, draft_tokens: int = 4, nudge: str = "Check your answer.", **kwargs):
        super().__init__(rollout, **kwargs)
        self.draft_tokens, self.nudge = draft_tokens, nudge

    async def turn(self, t, sampler, max_tokens: int):
        """One model turn of at most ``max_tokens`` tokens, appended to ``t``; its token ids."""
        out = await sampler.generate(t.context, max_tokens)
        t.add_model_turn(out.token_ids, out.log_probs, out.extras.get("token_versions"))
        t.messages.append({"role": "assistant", "content": self.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        return out.token_ids

    async def run_one(self, t, sampler) -> None:
        try:
            draft = await self.turn(t, sampler, min(self.draft_tokens, t.remaining))
            nudge = [{"role": "user", "content": self.nudge}]
            appended = self.chat.append_ids(nudge, draft[-1] if draft else None)
            if t.remaining > len(appended) and t.add_observation(appended):  # room for the nudge and an answer
                t.messages += nudge
                t.user_turns += 1
                await self.turn(t, sampler, t.remaining)
            t.finish = "answer"
        finally:
            sampler.retire()  # as AgentLoop.run_one: the other conversations' turns never wait for this one
