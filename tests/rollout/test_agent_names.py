"""verl's per-row ``agent_name``: each row runs with the loop it names, in the batch's order, turns batched together."""

import functools

import pytest

from rlflow.data import keys as K
from rlflow.data.prompts import DataError, collate, load_rows
from rlflow.rollout import HFRollout
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.tools import Calculator
from rlflow.tasks.calculator import CalculatorTask, chat_tokenizer
from tests.rollout.agent_helpers import call, replay_rollout


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


class Tagged(AgentLoop):
    """One model turn, then a user turn saying ``[tag]`` (the mark that this loop ran), then the end."""

    def __init__(self, rollout, tag: str, **kwargs):
        super().__init__(rollout, **kwargs)
        self.tag = tag

    async def run_one(self, t, sampler) -> None:
        try:
            out = await sampler.generate(t.context, t.remaining)
            t.add_model_turn(out.token_ids, out.log_probs)
            t.add_observation(self.chat.append_ids([{"role": "user", "content": f"[{self.tag}]"}], out.token_ids[-1]))
            t.user_turns += 1
            t.finish = "answer"
        finally:
            sampler.retire()


def echo_or_calc(context: str) -> str:
    """Answer 'about <question>'; a calculator call first when the tools are in the prompt."""
    question = context.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    if "tools: calculator" in context and "<|im_start|>tool" not in context:
        return call("calculator", expression="1+1")
    return f"about {question}"


def batch(tok, names):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": "", "data_source": "test",
             **({"agent_name": name} if name is not None else {})} for i, name in enumerate(names)]
    return collate(load_rows(rows)[0], tok)


def loops(tok, n=2):
    rollout = replay_rollout(tok, echo_or_calc, n=n)
    return AgentLoop(rollout, [Calculator()], name="tool_agent", agents={
        "alpha": functools.partial(Tagged, tag="alpha"), "beta": functools.partial(Tagged, tag="beta"),
        "single_turn_agent": AgentLoop})


def test_each_row_runs_with_the_loop_it_names_in_the_batch_order(tok):
    loop = loops(tok)
    names = ["alpha", None, "beta", "single_turn_agent", "alpha", "tool_agent"]
    out = loop(batch(tok, names))
    texts = out[K.RESPONSE_TEXT]
    assert out[K.GROUP].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert out[K.AGENT_NAME] == [name for name in names for _ in range(2)]
    for row, name in enumerate(names):
        for sample in (2 * row, 2 * row + 1):
            assert texts[sample].startswith(f"about q{row}" if name not in (None, "tool_agent") else "<tool_call>")
            assert (f"\n[{name}]\n" in texts[sample]) == (name in ("alpha", "beta")), texts[sample]
            turns = {"alpha": 3, "beta": 3, "single_turn_agent": 2, None: 4, "tool_agent": 4}[name]
            assert int(out[K.NUM_TURNS][sample]) == turns  # tools only where the row ran the tool loop
    # the tool loop's prompts carry the tool schemas; the others' do not
    prompts = out[K.PROMPT_TEXT]
    assert ["tools: calculator" in prompts[2 * row] for row in range(6)] == [False, True, False, False, False, True]
    assert loop.rollout.engine.calls == [12, 4]  # every row's first turn in one call; then the tool rows' answers


def test_a_name_no_loop_has_is_an_error_naming_the_row_and_the_names(tok):
    with pytest.raises(ValueError, match=r"batch row 1: agent_name='gamma' is not an agent loop of this run \(known: "
                                         r"alpha, beta, single_turn_agent, tool_agent;"):
        loops(tok)(batch(tok, ["alpha", "gamma"]))


def test_rows_without_agent_name_run_with_the_default_loop(tok):
    plain = batch(tok, [None, None])
    assert K.AGENT_NAME not in plain.keys()  # no row names a loop: no column
    out = loops(tok)(plain)
    assert all(t.startswith("<tool_call>") for t in out[K.RESPONSE_TEXT]) and out[K.NUM_TURNS].tolist() == [4] * 4


def test_validation_copies_make_their_own_loops_over_their_rollout(tok):
    loop = loops(tok, n=2)
    loop(batch(tok, ["alpha"]))
    val = loop.with_options(n=1)
    out = val(batch(tok, ["alpha", "beta"]))
    assert out.batch_size[0] == 2 and "[beta]" in out[K.RESPONSE_TEXT][1]
    assert val.loop_for("alpha").rollout is val.rollout and loop.loop_for("alpha").rollout is loop.rollout


def test_a_bad_agent_name_in_the_data_names_the_row():
    with pytest.raises(DataError, match=r"row 1: 'agent_name' must name an agent loop \(a string\), got 3"):
        load_rows([{"prompt": "a"}, {"prompt": "b", "agent_name": 3}])


# ------------------------------------------------------------------ the asynchronous modes' tests use these
def tagging_loop():
    """The calculator task's tool loop (``tool_agent``), with ``Tagged(tag="alpha")`` for rows naming ``alpha``."""
    return AgentLoop(HFRollout(n=2, temperature=1.0, max_new_tokens=64), CalculatorTask().tools(), max_assistant_turns=3,
                     name="tool_agent", agents={"alpha": functools.partial(Tagged, tag="alpha")})


def alpha_every_other_row(rows):
    return [dict(r, agent_name="alpha") if i % 2 else dict(r) for i, r in enumerate(rows)]


def each_row_ran_its_loop(*batches):
    """Each sample of ``batches`` ran with its row's loop; both loops ran."""
    names = [name for batch in batches for name in batch[K.AGENT_NAME]]
    texts = [text for batch in batches for text in batch[K.RESPONSE_TEXT]]
    assert "alpha" in names and None in names
    for name, text in zip(names, texts, strict=True):
        assert ("[alpha]" in text) == (name == "alpha"), (name, text)
