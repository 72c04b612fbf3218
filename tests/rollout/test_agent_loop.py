"""The agent loop between turns: tool calls, errors, concurrency, limits, interactions, masks, step rewards."""

import asyncio
import threading

import pytest
import torch

from rlflow.data import keys as K
from rlflow.rewards import FunctionReward
from rlflow.rewards.steps import WithStepRewards
from rlflow.rollout.agent import AgentLoop, ChatFormat, Interaction, RetryUntilCorrect
from rlflow.rollout.agent.loop import truncate_text
from rlflow.rollout.tools import Calculator, FunctionTool, Gsm8kTool, Tool
from rlflow.tasks.calculator import chat_tokenizer
from tests.rollout.agent_helpers import call, prompts, replay_rollout


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def last_tool_text(context: str) -> str | None:
    marker = "<|im_start|>tool\n"
    if marker not in context:
        return None
    return context[context.rindex(marker) + len(marker):].split("<|im_end|>")[0]


def calc_then_answer(context: str) -> str:
    """Call the calculator on the question, then answer with what it returned."""
    result = last_tool_text(context)
    if result is None:
        question = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        return call("calculator", expression=question)
    return f"the answer is {result}"


def test_trajectory_is_the_chat_template_rendering_and_masks_mark_model_tokens(tok):
    loop = AgentLoop(replay_rollout(tok, calc_then_answer, n=2), [Calculator()])
    out = loop(prompts(tok, ["123*456", "7-10"]))
    assert out[K.RESPONSE_TEXT][0].endswith("the answer is 56088") and out[K.RESPONSE_TEXT][2].endswith("is -3")
    chat = ChatFormat(tok, [Calculator().schema])
    masked = []
    for row in range(4):
        info = out[K.EXTRA_INFO][row]
        assert [m["role"] for m in info["messages"]] == ["user", "assistant", "tool", "assistant"]
        p, r = out[K.PROMPT_MASK][row].bool(), out[K.RESPONSE_MASK][row]
        last = int(r.nonzero().max()) + 1
        trajectory = out[K.PROMPT_IDS][row][p].tolist() + out[K.RESPONSE_IDS][row][:last].tolist()
        rendered = chat.encode(chat.render(info["messages"], add_generation_prompt=False))
        assert trajectory == rendered[:-1]  # the template's "\n" after the final <|im_end|> is not generated
        # mask 1 exactly on the two scripted turns (each ends with <|im_end|>); log-probs are the engine's
        question, answer = ["123*456", "7-10"][row // 2], ["56088", "-3"][row // 2]
        turns = [tok(call("calculator", expression=question), add_special_tokens=False)["input_ids"],
                 tok("the answer is " + answer, add_special_tokens=False)["input_ids"]]
        assert out[K.RESPONSE_IDS][row][r.bool()].tolist() == turns[0] + [tok.eos_token_id] + turns[1] + [tok.eos_token_id]
        expected = [-(i + 1) / 10 for i in range(len(turns[0]) + 1)] + [-(i + 1) / 10 for i in range(len(turns[1]) + 1)]
        assert torch.allclose(out[K.ROLLOUT_LOG_PROBS][row][r.bool()], torch.tensor(expected))
        assert (out[K.ROLLOUT_LOG_PROBS][row][~r.bool()] == 0).all()
        assert (r.diff() != 0).sum().item() in (2, 3)  # 1s, an interior span of 0s (the tool message), 1s[, padding]
        assert r[:last].tolist().count(0) > 0
        masked.append(r[:last].tolist().count(0))
        assert int(out[K.NUM_TURNS][row]) == 4 and info["tool_calls"] == 1 and info["finish_reason"] == "answer"
    assert out[K.GROUP].tolist() == [0, 0, 1, 1]
    assert loop.stats["agent/tool_calls/mean"] == 1 and loop.stats["agent/tool_error_rate"] == 0
    assert loop.stats["agent/masked_tokens/mean"] == sum(masked) / 4


def test_failing_tools_become_error_messages_and_are_counted(tok):
    class Crashes(Tool):
        name, parameters = "crashes", {"type": "object", "properties": {}}

        async def execute(self, args, **kw):
            raise RuntimeError("disk on fire")

    class Hangs(Tool):
        name, parameters, timeout_s = "hangs", {"type": "object", "properties": {}}, 0.2

        async def execute(self, args, **kw):
            await asyncio.sleep(60)

    scripts = {"a": call("crashes"), "b": call("hangs"), "c": call("nope"), "d": "<tool_call>{bad json</tool_call>",
               "e": call("calculator", expression="1/0")}

    def script(context):
        question = context.split("<|im_start|>user\n")[1][0]
        return scripts[question] if last_tool_text(context) is None else f"saw: {last_tool_text(context)}"

    loop = AgentLoop(replay_rollout(tok, script), [Calculator(), Crashes(), Hangs()])
    out = loop(prompts(tok, list("abcde")))
    seen = [m[-1]["content"] for m in (info["messages"] for info in out[K.EXTRA_INFO])]
    assert seen[0] == "saw: Error: crashes raised RuntimeError: disk on fire"
    assert seen[1] == "saw: Error: hangs timed out after 0.2 s"
    assert seen[2].startswith("saw: Error: there is no tool 'nope'; available: calculator, crashes, hangs")
    assert seen[3].startswith("saw: Error: the tool call is not valid JSON")
    assert seen[4] == "saw: Error: calculator: division by zero"
    s = loop.stats
    assert (s["agent/tool_errors/error"], s["agent/tool_errors/timeout"], s["agent/tool_errors/unknown_tool"],
            s["agent/tool_errors/parse"]) == (2, 1, 1, 1)
    assert s["agent/tool_error_rate"] == 1.0 and s["agent/finish/answer"] == 1.0


def test_tools_run_concurrently_within_a_turn_and_across_samples(tok):
    """Each call waits until all 6 calls (2 per turn x 3 samples) have started, so calls made one after the other
    would time out; then each sample calls a blocking tool (a plain def, run on a thread) that waits at a barrier
    for the other two. The rollout is started from inside a running event loop, as in Jupyter."""
    state = {"started": 0, "event": asyncio.Event()}  # binds to the loop that first awaits it

    class Rendezvous(Tool):
        name, parameters, timeout_s = "meet", {"type": "object", "properties": {}}, 20

        async def execute(self, args, **kw):
            state["started"] += 1
            if state["started"] == 6:
                state["event"].set()
            await state["event"].wait()
            return "met"

    class Blocking(Tool):
        name, parameters, timeout_s = "block", {"type": "object", "properties": {}}, 20
        barrier = threading.Barrier(3, timeout=15)

        def execute(self, args, **kw):
            self.barrier.wait()
            return "unblocked"

    def script(context):
        if last_tool_text(context) is None:
            return call("meet") + call("meet")
        return call("block") if "unblocked" not in context else "done"

    loop = AgentLoop(replay_rollout(tok, script), [Rendezvous(), Blocking()], max_parallel_calls=2)

    async def inside_a_running_loop():
        return loop(prompts(tok, ["x", "y", "z"]))

    out = asyncio.run(inside_a_running_loop())
    assert loop.stats["agent/tool_error_rate"] == 0, [i["messages"] for i in out[K.EXTRA_INFO]]
    assert all(i["messages"][-1]["content"] == "done" for i in out[K.EXTRA_INFO])
    assert loop.stats["agent/tool_calls/mean"] == 3


def test_turns_are_batched_into_one_engine_call_each(tok):
    loop = AgentLoop(replay_rollout(tok, calc_then_answer, n=4), [Calculator()])
    loop(prompts(tok, ["1+1", "2+2", "3+3"]))
    assert loop.rollout.engine.calls == [12, 12]  # two turns, all 12 samples in each call


def test_limits_parallel_calls_turns_budget_and_truncation(tok):
    many = call("calculator", expression="1+1") * 3
    loop = AgentLoop(replay_rollout(tok, lambda c: many, max_new_tokens=2000), [Calculator()], max_parallel_calls=2,
                     max_assistant_turns=3)
    out = loop(prompts(tok, ["q"]))
    info = out[K.EXTRA_INFO][0]
    assert [m["role"] for m in info["messages"]].count("tool") == 4  # 2 per turn, the third call dropped
    assert loop.stats["agent/dropped_calls"] == 2 and info["finish_reason"] == "max_assistant_turns"
    assert int(out[K.NUM_TURNS][0]) == 3 + 2 + 1

    budget = AgentLoop(replay_rollout(tok, lambda c: many), [Calculator()], max_response_tokens=150)
    out = budget(prompts(tok, ["q"]))
    assert out[K.RESPONSE_MASK].shape[1] <= 150 and out[K.EXTRA_INFO][0]["finish_reason"] == "length"
    # a tool message that fills the budget exactly ends the sample (no turn of 0 tokens is asked for)
    chat = ChatFormat(tok, [Calculator().schema])
    first = tok(call("calculator", expression="1+1"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    exact = len(first) + len(chat.append_ids([{"role": "tool", "name": "calculator", "content": "2"}], first[-1]))
    once = AgentLoop(replay_rollout(tok, lambda c: call("calculator", expression="1+1")), [Calculator()],
                     max_response_tokens=exact)
    out = once(prompts(tok, ["q"]))
    info = out[K.EXTRA_INFO][0]
    assert info["finish_reason"] == "length" and [m["role"] for m in info["messages"]][-1] == "tool"
    assert out[K.RESPONSE_MASK].shape[1] == exact and out[K.RESPONSE_MASK][0, -1] == 0

    assert truncate_text("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncate_text("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncate_text("abcdefghij", 4, "middle") == "ab...(truncated)...ij"
    assert truncate_text("abc", 4, "middle") == "abc"
    long = FunctionTool(lambda: "x" * 100, name="long", parameters={"type": "object", "properties": {}})
    loop = AgentLoop(replay_rollout(tok, lambda c: "ok" if last_tool_text(c) else call("long")), [long],
                     max_tool_response_length=10, tool_response_truncate_side="left")
    out = loop(prompts(tok, ["q"]))
    assert out[K.EXTRA_INFO][0]["messages"][2]["content"] == "x" * 10 + "...(truncated)"
    assert loop.stats["agent/truncated_tool_results"] == 1
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        AgentLoop(replay_rollout(tok, str), tool_response_truncate_side="top")
    with pytest.raises(ValueError, match="max_parallel_calls"):
        AgentLoop(replay_rollout(tok, str), max_parallel_calls=0)


def test_interaction_gives_user_turns_with_scores_and_its_own_limit(tok):
    def attempts(context):  # 6+7: wrong, wrong, right; 1+1: always wrong
        tries = context.count("try again")
        return ["12", "14", "13"][tries] if "6+7" in context else "3"

    retry = RetryUntilCorrect(lambda answer, truth: float(answer.strip() == truth))
    rows = prompts(tok, ["what is 6+7?", "what is 1+1?"], [{"interaction_kwargs": {"ground_truth": "13"}},
                                                           {"interaction_kwargs": {"ground_truth": "2"}}])
    loop = AgentLoop(replay_rollout(tok, attempts), interaction=retry, max_user_turns=5)
    out = loop(rows)
    first = out[K.EXTRA_INFO][0]["messages"]
    assert [m["content"] for m in first[1:]] == ["12", "That is wrong, try again.", "14", "That is wrong, try again.",
                                                 "13", "Correct."]
    assert out[K.EXTRA_INFO][0]["finish_reason"] == "interaction"
    assert out[K.STEP_REWARDS][0] == 1.0 and out[K.EXTRA_INFO][0]["rollout_reward_scores"]["turn_scores"] == [0, 0, 1]
    assert out[K.EXTRA_INFO][1]["finish_reason"] == "max_user_turns" and len(out[K.EXTRA_INFO][1]["messages"]) == 12
    # the second row never hears "Correct.": max_user_turns stops it (here after 1; above after 5 user turns)
    limited = AgentLoop(replay_rollout(tok, lambda c: "3"), interaction={"judge": retry}, max_user_turns=1)
    out = limited(rows)
    assert out[K.EXTRA_INFO][1]["finish_reason"] == "max_user_turns" and len(out[K.EXTRA_INFO][1]["messages"]) == 4
    assert loop.stats["num_turns/max"] == 5 + 6 + 1

    class Silent(Interaction):
        pass

    with pytest.raises(NotImplementedError):
        AgentLoop(replay_rollout(tok, str), interaction=Silent())(rows)


def test_step_rewards_from_tools_with_per_sample_kwargs_reach_the_score(tok):
    answers = {"six": ["5", "6"], "two": ["2", "2"]}

    def script(context):
        question = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        submitted = context.count("<|im_start|>tool")
        if submitted == 2:
            return "#### " + answers[question][-1]
        return call("calc_gsm8k_reward", answer=answers[question][submitted])

    extra = [{"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "6"}}}},
             {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}}}]
    loop = AgentLoop(replay_rollout(tok, script), [Gsm8kTool()])
    out = loop(prompts(tok, ["six", "two"], extra, ["6", "2"]))
    # six: score 0 (not above the best so far, 0: -0.05), then 1 (improves: 0); two: 1 (0), then 1 again (-0.05)
    assert out[K.STEP_REWARDS].tolist() == pytest.approx([-0.05 + 0.0, 0.0 - 0.05])
    assert loop.stats["agent/tool/calc_gsm8k_reward/score"] == pytest.approx(0.75)
    batch = out.clone()
    reward = WithStepRewards(FunctionReward(lambda response, truth: float(response.endswith("#### " + truth))))
    scored = reward(batch)
    assert scored[K.SCORES].tolist() == pytest.approx([0.95, 0.95])
    last = scored[K.RESPONSE_MASK].cumsum(-1).argmax(-1)
    assert scored[K.TOKEN_REWARDS].sum(-1).tolist() == pytest.approx([0.95, 0.95])
    assert scored[K.TOKEN_REWARDS][torch.arange(2), last].tolist() == pytest.approx([0.95, 0.95])
    assert reward.stats["reward/step_rewards/mean"] == pytest.approx(-0.05)


def test_concurrent_requests_and_dynamic_sampling_around_the_loop(tok):
    """One request per turn (servers) gives the same trajectories; DynamicSampling wraps the loop unchanged."""
    batched = AgentLoop(replay_rollout(tok, calc_then_answer, n=2), [Calculator()])
    direct = AgentLoop(replay_rollout(tok, calc_then_answer, n=2), [Calculator()], concurrent_requests=True)
    rows = prompts(tok, ["6*7", "9-2"])
    a, b = batched(rows), direct(rows)
    assert direct.rollout.engine.calls == [1] * 8 and batched.rollout.engine.calls == [4, 4]
    assert torch.equal(a[K.RESPONSE_IDS], b[K.RESPONSE_IDS]) and torch.equal(a[K.RESPONSE_MASK], b[K.RESPONSE_MASK])

    from rlflow.rollout import DynamicSampling

    turns = iter(range(10**6))

    def sometimes_right(context):  # alternate right and wrong answers, so groups are informative
        result = last_tool_text(context)
        if result is None:
            return call("calculator", expression=context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0])
        return result if next(turns) % 2 else "no idea"

    score = FunctionReward(lambda response, truth: float(response.endswith(truth)))
    sampler = DynamicSampling(AgentLoop(replay_rollout(tok, sometimes_right, n=2), [Calculator()]), score)
    sampler.bind_prompts(iter([]))
    out = sampler(prompts(tok, ["6*7", "9-2"], ground_truths=["42", "7"]))
    assert out.batch_size[0] == 4 and sorted(out[K.SCORES].tolist()) == [0.0, 0.0, 1.0, 1.0]
    assert sampler.stats["agent/tool_calls/mean"] == 1 and sampler.stats["dapo/kept_group_frac"] == 1.0


def test_a_tokenizer_without_chat_template_is_refused_before_sampling():
    from rlflow.data.prompts import collate, load_rows
    from rlflow.models.tiny import char_tokenizer

    plain = char_tokenizer()
    loop = AgentLoop(replay_rollout(plain, lambda c: "1"), [Calculator()])
    with pytest.raises(ValueError, match="has none: set tokenizer.chat_template"):
        loop(collate(load_rows([{"prompt": "1+1", "ground_truth": "2"}])[0], plain))
    assert loop.rollout.engine.calls == []


def test_vllm_tool_parsers_read_other_chat_template_formats(tok):
    """``format="vllm:<name>"``: vLLM's own parser reads the calls (here its ``pythonic`` format, Llama 3.2/4's
    ``[name(arg=...)]``), the loop runs them as with Hermes; a parser vLLM lacks is named with vLLM's list."""
    pytest.importorskip("vllm.tool_parsers")

    def pythonic(context):
        if "<|im_start|>tool\n" not in context:
            question = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            return f'[calculator(expression="{question}"), calculator(expression=7)]'
        return "the answer is " + context.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]

    loop = AgentLoop(replay_rollout(tok, pythonic), [Calculator()], format="vllm:pythonic", max_parallel_calls=2)
    out = loop(prompts(tok, ["12*34"]))
    messages = out[K.EXTRA_INFO][0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[2]["content"] == "408" and messages[3]["content"].startswith("Error: calculator: ")  # 7: no str
    assert messages[4]["content"] == "the answer is 408"
    assert loop.stats["agent/tool_calls/mean"] == 2 and loop.stats["agent/tool_errors/error"] == 1
    with pytest.raises(ValueError, match="vLLM has no tool parser 'nope'; its parsers: .*hermes"):
        AgentLoop(replay_rollout(tok, pythonic), [Calculator()], format="vllm:nope")



def test_a_batched_call_that_cannot_be_built_fails_its_waiting_samples(tok):
    """An error while the batcher builds a call (here a 0-token request) reaches the samples waiting on it."""
    from rlflow.rollout.agent.batching import TurnBatcher

    rollout = replay_rollout(tok, lambda c: "ok")
    batcher = TurnBatcher(rollout.engine, rollout.params, live=1)

    async def ask():
        return await asyncio.wait_for(batcher.generate([1, 2], 0), timeout=10)

    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        asyncio.run(ask())
