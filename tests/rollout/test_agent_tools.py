"""Tools on their own: the calculator, the Hermes parser, argument checks, verl's tool and interaction YAML."""

import asyncio
import textwrap

import pytest

from rlflow.rollout.agent import Gsm8kInteraction
from rlflow.rollout.tools import (Calculator, FunctionTool, Gsm8kTool, HermesParser, Tool, ToolConfigError, ToolError,
                                  ToolResult, load_interaction_config, load_tool_config, tool_parser)
from rlflow.rollout.tools.calculator import evaluate, format_number


@pytest.mark.parametrize("expression, expected", [
    ("123*456", 56088), ("(7 - 2) / 4", 1.25), ("2 ** 100 % 7", 2), ("-3 + +4", 1), ("17 // 5", 3),
    ("123456789 * 987654321", 121932631112635269), ("1.5 * 2", 3.0),
])
def test_calculator_evaluates_arithmetic_exactly(expression, expected):
    assert evaluate(expression) == expected  # 2**100 = 1267650600228229401496703205376; % 7 by hand: 2


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('ls')", "only numbers"), ("x + 1", "only numbers"), ("1/0", "division by zero"),
    ("9**9**9", "exponent"), ("(2**1000)**1000", "more than 4000 digits"), ("1 +", "cannot parse"), ("", "empty"),
    ("1" * 300, "longer than"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_numbers_are_printed_plainly():
    assert [format_number(x) for x in (56088, 3.0, 1.25, 1 / 3)] == ["56088", "3", "1.25", "0.333333333333"]


def test_hermes_parser_reads_calls_and_reports_bad_ones():
    parse = tool_parser("hermes").parse
    text, calls = parse('I will compute. <tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>'
                        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert text == "I will compute." and [(c.name, c.arguments, c.error) for c in calls] == [
        ("calc", {"expr": "1+1"}, None), ("f", {"a": 1}, None)]
    _, calls = parse("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"x\"")
    assert [c.error is not None for c in calls] == [True, True, True]
    assert "not valid JSON" in calls[0].error and "needs" in calls[1].error and "unterminated" in calls[2].error
    assert parse("plain answer 42") == ("plain answer 42", [])
    with pytest.raises(ValueError, match="unknown tool-call format"):
        tool_parser("mystery")
    assert isinstance(tool_parser(HermesParser()), HermesParser)


def test_tool_checks_arguments_against_its_schema():
    calc = Calculator()
    assert calc.schema == {"type": "function", "function": {"name": "calculator", "description": calc.description,
                                                            "parameters": calc.parameters}}
    assert asyncio.run(calc({"expression": "6*7"}, session={})).text == "42"
    with pytest.raises(ToolError, match="missing required"):
        asyncio.run(calc({}, session={}))
    with pytest.raises(ToolError, match="must be string"):
        asyncio.run(calc({"expression": 5}, session={}))
    with pytest.raises(ToolError, match="JSON object"):
        asyncio.run(calc(["6*7"], session={}))


def test_function_tool_and_result_forms():
    def add(a, b):
        """Add two integers."""
        return str(a + b), 0.5

    tool = FunctionTool(add, parameters={"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}}})
    assert tool.name == "add" and tool.description == "Add two integers."
    out = asyncio.run(tool({"a": 2, "b": 3}, session={}))
    assert (out.text, out.reward) == ("5", 0.5)
    with pytest.raises(ToolError, match="must be integer"):
        asyncio.run(tool({"a": True, "b": 3}, session={}))  # a bool is not a JSON integer

    class Bad(Tool):
        name = "bad"

        async def execute(self, args, **kw):
            return 42

    with pytest.raises(TypeError, match="returned int"):
        asyncio.run(Bad()({}, session={}))
    with pytest.raises(ValueError, match="has no name"):
        type("Nameless", (Tool,), {})()


def test_gsm8k_tool_scores_answers_with_verl_step_rewards():
    tool, session = Gsm8kTool(), {}
    wrong = asyncio.run(tool({"answer": "71"}, session=session, ground_truth="72"))
    right = asyncio.run(tool({"answer": "72"}, session=session, ground_truth="72"))
    again = asyncio.run(tool({"answer": "72"}, session=session, ground_truth="72"))
    # verl: 0 when the score improves on the best so far, -0.05 otherwise
    assert [r.reward for r in (wrong, right, again)] == [-0.05, 0.0, -0.05]
    assert right.text == "Current parsed answer='72' reward=1.0" and right.metrics == {"score": 1.0}


def test_verl_tool_config_builds_rlflow_tools(tmp_path):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent("""
        from rlflow.rollout.tools import Tool

        class Echo(Tool):
            name = "echo"

            async def execute(self, args, **kw):
                return self.config["prefix"] + args.get("text", "")
    """))
    config = tmp_path / "tools.yaml"
    config.write_text(textwrap.dedent(f"""
        tools:
          - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
            config: {{type: native}}
            tool_schema:
              type: function
              function:
                name: calc_gsm8k_reward
                description: "check an answer"
                parameters: {{type: object, properties: {{answer: {{type: string}}}}, required: [answer]}}
          - class_name: rlflow.rollout.tools.Calculator
            config: {{timeout_s: 2}}
          - class_name: "{tmp_path / 'my_tools.py'}:Echo"
            config: {{prefix: ">"}}
    """))
    gsm8k, calc, echo = load_tool_config(config)
    assert isinstance(gsm8k, Gsm8kTool) and gsm8k.description == "check an answer"
    assert calc.name == "calculator" and calc.timeout_s == 2
    assert asyncio.run(echo({"text": "hi"}, session={})).text == ">hi"


@pytest.mark.parametrize("entry, message", [
    ("- class_name: verl.tools.mcp_search_tool.MCPSearchTool", "MCP servers"),
    ("- class_name: verl.tools.search_tool.SearchTool", "a retrieval server"),
    ("- class_name: rlflow.rollout.tools.Calculator\n  config: {type: mcp}", "only native"),
    ("- class_name: no.such.module.Tool", "cannot import"),
    ("- class_name: rlflow.rollout.tools.NoSuchTool", "has no class"),
    ("- class_name: rlflow.rollout.agent.AgentLoop", "is not an rlflow.rollout.tools.Tool"),
    ("- config: {}", "needs class_name"),
    ("- class_name: rlflow.rollout.tools.Calculator\n- class_name: rlflow.rollout.tools.Calculator", "second tool"),
])
def test_tool_config_errors_name_the_file_and_entry(tmp_path, entry, message):
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n" + textwrap.indent(entry, "  "))
    with pytest.raises(ToolConfigError, match=message) as err:
        load_tool_config(config)
    assert str(config) in str(err.value) and "tools[" in str(err.value)


def test_verl_interaction_config(tmp_path):
    config = tmp_path / "interaction.yaml"
    config.write_text("interaction:\n  - name: gsm8k\n    class_name: "
                      "verl.interactions.gsm8k_interaction.Gsm8kInteraction\n    config: {}\n")
    interactions = load_interaction_config(config)
    assert list(interactions) == ["gsm8k"] and isinstance(interactions["gsm8k"], Gsm8kInteraction)
    gsm8k = interactions["gsm8k"]
    stop, text, reward, _ = asyncio.run(gsm8k.generate_response("i", [{"role": "assistant", "content": "#### 7"}],
                                                                ground_truth="7"))
    assert (stop, reward) == (True, 1.0) and text == "Your response is correct!"
    stop, text, reward, _ = asyncio.run(gsm8k.generate_response("i", [{"role": "assistant", "content": "8"}],
                                                                ground_truth="7"))
    assert (stop, reward) == (False, 0.0) and "incorrect" in text


def test_tool_result_defaults():
    assert ToolResult("x") == ToolResult("x", None, {}, None)
