"""Config as a component tree: a recipe names the callables and their arguments, and building it is calling them.

A tree recipe is YAML whose nodes name a callable with ``_target_`` and give its arguments::

    policy:    {_target_: rlflow.Policy.from_pretrained, model: models/qwen}
    rollout:   {_target_: rlflow.HFRollout, n: 8, max_new_tokens: 256}
    reward:    {_target_: rlflow.FunctionReward, fn: {_target_: hydra.utils.get_method, path: my_rewards.score}}
    estimator: {_target_: rlflow.GRPO}
    loss:      {_target_: rlflow.PPOLoss, clip_ratio: 0.2}
    optim:     {lr: 1.0e-6}                     # the Trainer's five groups may leave out their _target_
    data:      {_target_: rlflow.PromptData, train: train.parquet, val: test.parquet}

The root is the :class:`~rlflow.trainer.trainer.Trainer` (another class with a root ``_target_``): every key but
``data`` is one of its arguments, and ``data`` is what ``fit`` trains on. Any class or function is a ``_target_``:
rlflow's, or the user's by import path (``my_pkg.module.Name``) or by file (``my_est.py:Name``, relative to the
recipe's folder, as elsewhere in rlflow's config). A new constructor argument needs no config code.

**Why Hydra's ``_target_`` and not torchtune's ``_component_``.** verl's users already read Hydra configs, and
verl's own YAML carries ``_target_`` nodes; hydra-core is a dependency already, and ``hydra.utils.instantiate``
brings nested instantiation, ``_partial_`` (a callable that is called later, e.g. an optimizer factory),
``_args_`` and ``_convert_`` with semantics documented and known. A function named as an argument (a reward's
``fn``) is Hydra's own idiom, ``{_target_: hydra.utils.get_method, path: ...}``. torchtune's ``_component_`` would
need an instantiate of our own with the same features and a vocabulary verl users do not know.

What this module adds to Hydra: :func:`check` resolves every ``_target_`` (imports its module, builds nothing)
and binds every node's keys to the callable's signature -- unknown names (with the closest parameter), missing
required arguments, targets that do not resolve -- and reports every problem at once in one
:class:`~rlflow.config.errors.ConfigError`, with the path of each key (``loss.clip_ratoi``); then :func:`build`
hands the checked tree, its targets resolved, to ``hydra.utils.instantiate``. :mod:`rlflow.config.components_python`
prints a tree as the Python a user would write (the dry run).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from pathlib import Path
from typing import Any, Callable

import yaml
from hydra.utils import get_class, get_method, get_object, instantiate
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlflow.config.errors import ConfigError, raise_problems
from rlflow.registry import is_file_location, load_object, split_spec
from rlflow.trainer.options import FLAT, GROUPS

TRAINER = "rlflow.Trainer"
DATA = "data"  # the root key that is fit's argument, not the Trainer's
KEYWORDS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")  # Hydra's reserved keys
NAMERS = (get_method, get_object, get_class)  # {_target_: hydra.utils.get_method, path: x}: the object x itself
NAMER_PATHS = {f"hydra.utils.{f.__name__}" for f in NAMERS}
GROUP_TARGETS = {arg: f"rlflow.{cls.__name__}" for arg, cls in GROUPS.items()}  # rlflow exports the five


def is_tree(data: Any) -> bool:
    """A loaded YAML recipe is a component tree when its root or one of its top-level sections names a
    ``_target_`` that is not verl's (verl's own YAML has ``critic: {_target_: verl.workers.config...}`` nodes)."""
    if not isinstance(data, dict):
        return False
    targets = [data.get("_target_")] + [v.get("_target_") for v in data.values() if isinstance(v, dict)]
    return any(isinstance(t, str) and not t.startswith("verl.") for t in targets)


def is_tree_file(path: str | Path) -> bool:
    """Whether the YAML file ``path`` is a component tree (see :func:`is_tree`); a file that does not parse is not."""
    try:
        return is_tree(yaml.safe_load(Path(path).expanduser().read_text()))
    except (OSError, yaml.YAMLError):
        return False


def load(path: str | Path, overrides: list[str] | tuple = ()) -> dict:
    """The tree of a YAML file with ``key=value`` overrides applied (Hydra's syntax: ``loss.clip_ratio=0.3``,
    ``+key=value`` to add, ``~key`` to delete; values are YAML, and ``loss={_target_: ..., ...}`` replaces the whole
    node), the Trainer's groups given their ``_target_``."""
    path = Path(path).expanduser()
    try:
        cfg = OmegaConf.load(path)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read the recipe: {e}") from None
    for item in overrides:
        if item.startswith("~"):
            parent, _, leaf = item[1:].rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ConfigError(f"{item}: {item[1:]} is not in the recipe {path}")
            node.pop(leaf)
            continue
        key, eq, value = item.lstrip("+").partition("=")
        if not eq or not key:
            raise ConfigError(f"{item}: an override is key=value (e.g. loss.clip_ratio=0.3)")
        try:
            parsed = OmegaConf.from_dotlist([f"value={value}"])["value"]  # YAML, with OmegaConf's floats (1e-3)
            OmegaConf.update(cfg, key, parsed, merge=False, force_add=True)  # a node given whole replaces the old one
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(f"{item}: cannot apply the override: {e}") from None
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # an ${interpolation} that does not resolve
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of the Trainer's arguments, got {type(tree).__name__}")
    for arg, target in GROUP_TARGETS.items():  # optim: {lr: ...} means Optim(lr=...)
        if isinstance(tree.get(arg), dict) and "_target_" not in tree[arg]:
            tree[arg] = {"_target_": target, **tree[arg]}
    return tree


def locate(target: Any, where: str, base_dir: str | Path | None = None) -> Callable:
    """The callable a ``_target_`` names: ``pkg.module.Name`` (``Name.attr`` too: ``rlflow.Policy.from_pretrained``)
    or ``file.py:Name``; a :class:`LookupError` naming ``where`` and what is missing otherwise."""
    if callable(target) and not isinstance(target, str):  # a tree made in Python may hold the callable itself
        return target
    if not isinstance(target, str) or not target:
        raise LookupError(f"{where}: a _target_ is a dotted path or file.py:Name, got {target!r}")
    obj = named(target, where, base_dir)
    if not callable(obj):
        raise LookupError(f"{where}: {target} is a {type(obj).__name__}, not a class or function")
    return obj


def named(spec: str, where: str, base_dir: str | Path | None = None) -> Any:
    """The object ``spec`` names (``pkg.module.Name`` or ``file.py:Name``), any kind of object."""
    location = split_spec(spec)
    return load_object(*location, where, base_dir) if location else _dotted(spec, where, is_file_location(spec))


def _dotted(target: str, where: str, looks_like_file: bool) -> Any:
    parts = target.split(".")
    module, i = None, len(parts)
    while i > 0 and module is None:  # the longest importable prefix is the module
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name != ".".join(parts[:i]) and not ".".join(parts[:i]).startswith(f"{e.name}."):
                raise LookupError(f"{where}: importing {'.'.join(parts[:i])} raised {e!r}") from None
            i -= 1
        except Exception as e:  # the module exists but fails to import: its own error
            raise LookupError(f"{where}: importing {'.'.join(parts[:i])} raised {e!r}") from None
    if module is None:
        hint = "; a file's class is file.py:Name" if looks_like_file else ""
        raise LookupError(f"{where}: no importable module in {target!r}{hint}")
    obj = module
    for j, name in enumerate(parts[i:], start=i):
        if not hasattr(obj, name):
            names = [n for n in dir(obj) if not n.startswith("_")] + list(getattr(obj, "__all__", ()))
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {'.'.join(parts[:j] + [close[0]])}?)" if close else ""
            raise LookupError(f"{where}: {'.'.join(parts[:j])} has no {name!r}{hint}")
        obj = getattr(obj, name)
    return obj


def check(tree: dict, base_dir: str | Path | None = None) -> list[ConfigError]:
    """Every problem of a tree, each naming its key's path; nothing is built (modules are imported)."""
    problems: list[ConfigError] = []
    root = {k: v for k, v in tree.items() if k != DATA}
    root.setdefault("_target_", TRAINER)
    _check_node(root, "", base_dir, problems, root=True)
    if DATA not in tree:
        problems.append(ConfigError(f"{DATA}: missing: the prompts fit trains on, e.g. "
                                    "{_target_: rlflow.PromptData, train: train.parquet, val: test.parquet}"))
    else:
        _walk(tree[DATA], DATA, base_dir, problems)
    return problems


def _walk(value: Any, path: str, base_dir, problems: list[ConfigError]) -> None:
    if isinstance(value, dict):
        if "_target_" in value:
            _check_node(value, path, base_dir, problems)
        else:
            for key, item in value.items():
                _walk(item, f"{path}.{key}", base_dir, problems)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", base_dir, problems)


def _check_node(node: dict, path: str, base_dir, problems: list[ConfigError], root: bool = False) -> None:
    """The node's own problems (its target, its keys against the signature), then its arguments' nodes'."""
    at = (lambda key: f"{path}.{key}" if path else key)
    unknown = [k for k in node if k.startswith("_") and k.endswith("_") and k not in KEYWORDS]
    problems += [ConfigError(f"{at(k)}: not a Hydra keyword ({', '.join(KEYWORDS)})") for k in unknown]
    names = [k for k in node if k not in KEYWORDS and k not in unknown]
    args = node.get("_args_", [])
    if not isinstance(args, list):
        problems.append(ConfigError(f"{at('_args_')}: a list of positional arguments, got {args!r}"))
        args = []
    try:
        target = locate(node["_target_"], at("_target_"), base_dir)
    except LookupError as e:
        problems.append(ConfigError(str(e)))
        target = None
    if target in NAMERS and isinstance(node.get("path"), str):  # the object it names must exist too
        try:
            named(node["path"], at("path"), base_dir)
        except LookupError as e:
            problems.append(ConfigError(str(e)))
    if target is not None:
        problems += _bind(target, node, names, len(args), path, root)
    for i, item in enumerate(args):
        _walk(item, f"{at('_args_')}[{i}]", base_dir, problems)
    for key in names:
        _walk(node[key], at(key), base_dir, problems)


def _bind(target: Callable, node: dict, names: list[str], n_args: int, path: str, root: bool) -> list[ConfigError]:
    """The node's argument names against ``target``'s signature (as ``inspect.Signature.bind`` would)."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: Python checks the call itself
        return []
    shown = node["_target_"] if path else f"{node['_target_']} (the recipe's root)"
    at = (lambda key: f"{path}.{key}" if path else key)
    # the Trainer's **legacy (flat, deprecated keywords) is not open to a tree: a flat key is named as one
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params) and not (root and node["_target_"] == TRAINER)
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    problems = []
    for key in names:
        if key in by_name or open_ended:
            continue
        close = difflib.get_close_matches(key, list(by_name), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if root and key in FLAT:
            arg, _, field = FLAT[key]
            hint = f" (it belongs in its group: {arg}: {{{field}: ...}})"
        problems.append(ConfigError(f"{at(key)}: not a parameter of {shown}{hint}; its parameters: "
                                    f"{', '.join(by_name) or 'none'}"))
    if not node.get("_partial_", False):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        by_position = {p.name for p in positional[:n_args]}
        for p in params:
            if (p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                    and p.name not in names and p.name not in by_position):
                problems.append(ConfigError(f"{at(p.name)}: missing: a required argument of {shown}"))
    return problems


def resolved(value: Any, path: str = "", base_dir=None) -> Any:
    """A copy of a checked tree with each ``_target_`` replaced by the callable it names (Hydra takes either;
    ``file.py:Name`` targets are rlflow's)."""
    if isinstance(value, dict):
        if value.get("_target_") in NAMER_PATHS and isinstance(value.get("path"), str) and set(value) == {"_target_", "path"}:
            return named(value["path"], f"{path}.path", base_dir)  # the object itself (a file's function too)
        out = {k: resolved(v, f"{path}.{k}", base_dir) for k, v in value.items() if k != "_target_"}
        return {"_target_": locate(value["_target_"], f"{path}._target_", base_dir), **out} if "_target_" in value else out
    if isinstance(value, list):
        return [resolved(v, f"{path}[{i}]", base_dir) for i, v in enumerate(value)]
    return value


def build(tree: dict, base_dir: str | Path | None = None) -> tuple[Any, Any]:
    """``(trainer, data)`` of a tree, checked first (every problem in one :class:`ConfigError`); arguments are
    built before what takes them, in the recipe's order."""
    trainer = build_trainer(tree, base_dir)
    return trainer, instantiate(resolved(tree[DATA], DATA, base_dir), _convert_="all")


def build_trainer(tree: dict, base_dir: str | Path | None = None) -> Any:
    """The tree's Trainer alone (its ``data`` is checked, not built), checked first as :func:`build`."""
    raise_problems(check(tree, base_dir))
    root = {"_target_": TRAINER, **{k: v for k, v in tree.items() if k != DATA}}
    return instantiate(resolved(root, "", base_dir), _convert_="all")
