"""verl's ``function_tool_path`` keys (``multi_turn.function_tool_path``, ``data.function_tool_path``) through the
verl entry point: a file of ``@function_tool`` functions, written for verl, gives the agent loop its tools and
the length filter their schemas."""

import asyncio
import json
import sys

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_data, build_trainer, load_tokenizer
from rlflow.config.verl.loading import ConfigError
from tests.config.test_multi_turn_keys import chat_model_dir  # noqa: F401 - the fixture

MT = "actor_rollout_ref.rollout.multi_turn"
TOOLS = '''
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@function_tool("lookup")
def find_capital(country: str):
    """Look up a country's capital.

    Args:
        country: The country's name.
    """
    return {"capital": "Paris"} if country == "France" else ("unknown", -0.5, {"misses": 1})
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def test_function_tools_reach_the_agent_loop(tiny, tmp_path):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    plan = make_plan(load_config(tiny + [f"{MT}.enable=true", f"{MT}.function_tool_path={tmp_path}/my_tools.py"]))
    tools = {t.name: t for t in plan.agent["tools"]}
    assert sorted(tools) == ["add", "lookup"] and "verl" not in sys.modules  # verl's import: for the file's run only
    assert tools["add"].schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer", "description": "The first number."}
    assert tools["lookup"].schema["function"]["description"] == "Look up a country's capital."
    assert asyncio.run(tools["add"].execute({"a": 2, "b": 3})) == "5"
    assert json.loads(asyncio.run(tools["lookup"].execute({"country": "France"}))) == {"capital": "Paris"}
    assert asyncio.run(tools["lookup"].execute({"country": "Spain"})) == ("unknown", -0.5, {"misses": 1})
    trainer, _ = build_trainer(plan)  # the run's tree loads the file: tools=load_function_tools(path=...)
    assert sorted(trainer.rollout.tools) == ["add", "lookup"]
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"function_tool_path=.*defines no @function_tool"):
        make_plan(load_config(tiny + [f"{MT}.enable=true", f"{MT}.function_tool_path={tmp_path}/none.py"]))
    with pytest.raises(ConfigError, match="enable=False"):
        make_plan(load_config(tiny + [f"{MT}.function_tool_path={tmp_path}/my_tools.py"]))


def test_data_function_tool_path_renders_the_schemas_into_the_measured_prompt(tiny, tmp_path, chat_model_dir):
    (tmp_path / "my_tools.py").write_text(TOOLS)
    base = tiny + [f"actor_rollout_ref.model.path={chat_model_dir}", "data.max_prompt_length=4096"]

    def longest(extra):
        plan = make_plan(load_config(base + extra))
        tokenizer = load_tokenizer(plan)
        data = build_data(plan, tokenizer)
        return max(data.prompt_length(r, tokenizer) for r in data.train), data

    plain, _ = longest([])
    with_tools, data = longest([f"data.function_tool_path={tmp_path}/my_tools.py"])
    assert [s["function"]["name"] for s in data.tool_schemas] == ["add", "lookup"]
    # the template's system line lists the tools: "tools: add(), lookup()" (rlflow.tasks.calculator's template)
    assert with_tools > plain + len("tools: add(), lookup()")
