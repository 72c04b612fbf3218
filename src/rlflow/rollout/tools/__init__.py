"""Tools an agent rollout can call: the ``Tool`` base, built-ins, parsers and verl's tool YAML loader."""

from rlflow.rollout.tools.base import FunctionTool, Tool, ToolError, ToolResult
from rlflow.rollout.tools.calculator import Calculator
from rlflow.rollout.tools.config import ToolConfigError, load_interaction_config, load_tool_config
from rlflow.rollout.tools.functions import function_tool, load_function_tools
from rlflow.rollout.tools.gsm8k import Gsm8kTool
from rlflow.rollout.tools.parsers import HermesParser, ToolCall, ToolParser, tool_parser
from rlflow.rollout.tools.python import PythonTool

__all__ = ["Tool", "ToolResult", "ToolError", "FunctionTool", "Calculator", "Gsm8kTool", "PythonTool", "ToolCall", "ToolParser",
           "HermesParser", "tool_parser", "load_tool_config", "load_interaction_config", "ToolConfigError",
           "function_tool", "load_function_tools"]
