"""Load a verl-style config: the packaged default tree, the user's YAML, then Hydra-syntax overrides.

``key=value`` changes a key, ``+key=value`` adds one (only where the tree is open, e.g. under
``override_config``; still validated; on a key the tree has, it sets it, since verl versions differ in
which keys need the ``+``), ``++key=value`` sets whether or not it exists, ``key=[a,b]``
gives a list. Overrides are parsed with Hydra's own grammar. Every key is then checked against the
default tree: an unknown one is an error naming the full dotted key and its closest matches.
"""

from __future__ import annotations

import difflib
import numbers
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlflow.config.errors import ConfigError, ConfigProblems, NotSupportedError, raise_problems  # noqa: F401 (re-exported)
from rlflow.config.trees import flatten, strip_targets
from rlflow.config.verl.configs import (GROUP_KEYS, compose_overlay, default_container, default_tree, open_nodes,
                                        resolved_defaults)
from rlflow.config.verl.reward_section import fold, verl09_name

DEFAULTS_FILE = Path(__file__).with_name("defaults.yaml")


class VerlConfig:
    """The resolved config: ``cfg["a.b.c"]`` reads a key and records that it was read.

    ``provided`` holds the dotted keys the user's YAML or overrides set; ``defaults`` the resolved
    default tree. What was read tells, after building, which provided keys changed nothing. ``aliased``: the
    legacy reward keys that carry a ``reward.*`` key the user set (:mod:`rlflow.config.verl.reward_section`).
    """

    def __init__(self, tree: dict, provided: set[str], defaults: dict, deps: dict[str, list[str]] | None = None,
                 bad_keys: set[str] = frozenset()):
        self.tree, self.provided, self.defaults = tree, provided, defaults
        self.flat, self.default_flat = flatten(tree), flatten(defaults)
        self.deps = deps or {}  # key -> keys its ${...} interpolation reads
        self.read: set[str] = set()
        self.bad_keys = set(bad_keys)  # keys whose value has the wrong type (already reported): not checked further
        self.validated = False
        self.notes: list[str] = []  # about keys loading took but that change nothing (hydra.*)
        self.typed: set[str] = set()  # the provided keys that came from command-line overrides
        self.aliased: dict[str, str] = {}

    def __getitem__(self, key: str) -> Any:
        node = self.tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"config has no key {key!r}")
            node = node[part]
        todo = [k for k in self.flat if k == key or k.startswith(key + ".")]
        while todo:  # reading an interpolated key reads what it points to
            k = todo.pop()
            if k not in self.read:
                self.read.add(k)
                todo += self.deps.get(k, [])
                if verl09_name(k):  # a legacy reward key: its verl 0.9 name (reward.*) is used with it
                    self.read.add(verl09_name(k))
        return node

    def is_provided(self, key: str) -> bool:
        return any(k == key or k.startswith(key + ".") for k in (*self.provided, *self.aliased))

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.tree))


def close_matches(key: str, known: list[str], n: int = 3) -> list[str]:
    """Closest known dotted keys: by the full key, then by its last part."""
    matches = difflib.get_close_matches(key, known, n=n, cutoff=0.6)
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.75):
        full = [k for k in known if k.rsplit(".", 1)[-1] == name]
        matches += [k for k in full if k not in matches]
    return matches[:n]


def unknown_key_error(key: str, known: list[str], hint: str = "") -> ConfigError:
    suggestions = close_matches(key, known)
    did_you_mean = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
    return ConfigError(f"unknown config key '{key}'.{did_you_mean}{hint}")


def _known_keys(defaults: dict) -> list[str]:
    return list(flatten(defaults))


def _node(defaults: dict, key: str) -> tuple[bool, bool]:
    """(exists, open) for a dotted key of the (plain, unresolved) default tree; open: an empty dict
    above or at it, or a node rlflow's file leaves open."""
    node: Any = defaults
    path, opened = "", open_nodes(DEFAULTS_FILE)
    for part in key.split("."):
        if isinstance(node, dict) and (len(node) == 0 or path in opened):
            return False, True  # under an open node: any key may be added
        if not isinstance(node, dict) or part not in node:
            return False, False
        node, path = node[part], f"{path}.{part}" if path else part
    return True, isinstance(node, dict) and (len(node) == 0 or key in opened)


def check_keys(tree: Any, defaults: dict, prefix: str = "", source: str = "",
               problems: list[ConfigError] | None = None) -> Any:
    """Every key of ``tree`` must exist in the default tree or sit under an open node.

    Unknown keys are appended to ``problems`` (raised at the first one when it is ``None``) and
    left out of the returned tree, so that the rest of the config can still be checked.
    """
    if not isinstance(tree, dict):
        return tree
    kept = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        exists, open_ = _node(defaults, key)
        if not exists and not open_:
            error = unknown_key_error(key, _known_keys(defaults), f" (in {source})" if source else "")
            if problems is None:
                raise error
            problems.append(error)
            continue
        kept[k] = check_keys(v, defaults, key + ".", source, problems) if exists and not open_ else v
    return kept


def load_yaml(path: Path) -> dict:
    """A user's YAML as a plain (unresolved) dict; Hydra's ``defaults``/``hydra`` blocks are handled."""
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except (OSError, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys, got {type(tree).__name__}")
    for entry in tree.pop("defaults", None) or []:
        name = entry if isinstance(entry, str) else None
        if name not in ("_self_", "ppo_trainer"):
            raise ConfigError(f"{path}: defaults entry {entry!r}: composing other config files is not supported "
                              "yet; rlflow always starts from verl's ppo_trainer tree")
    tree.pop("hydra", None)  # searchpath etc.: rlflow's tree is verl's ppo_trainer
    return strip_targets(tree)


def parse_override(parser, text: str):
    """One override in Hydra's grammar; an unquoted value it rejects (e.g. ``~/data/x``) is taken as a string."""
    from hydra.errors import OverrideParseException

    try:
        [o] = parser.parse_overrides([text])
    except OverrideParseException as e:
        key, sep, value = text.partition("=")
        if not sep or "'" in value:
            raise ConfigError(f"cannot parse override {text!r}: {e}") from e
        [o] = parser.parse_overrides([f"{key}='{value}'"])
    if o.is_sweep_override():
        raise ConfigError(f"override {text!r} is a multirun sweep, which rlflow does not run; quote the value "
                          f"for a string with commas ({o.key_or_group}='...')")
    return o


def parse_overrides(overrides: list[str], problems: list[ConfigError] | None = None) -> list:
    """Parsed overrides; one that does not parse goes to ``problems`` (raised when it is ``None``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, parsed = OverridesParser.create(), []
    for text in overrides:
        try:
            parsed.append(parse_override(parser, text))
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(e)
    return parsed


def apply_override(cfg: DictConfig, defaults: dict, o, provided: set[str]) -> None:
    from hydra.core.override_parser.types import OverrideType

    key, value = o.key_or_group, (None if o.type == OverrideType.DEL else o.value())
    exists, open_ = _node(defaults, key)
    if o.type == OverrideType.DEL:
        raise ConfigError(f"override '~{key}': deleting keys is not supported; set {key}=null instead")
    if not exists and not open_:
        hint = " ('+' adds keys only under open nodes such as override_config)" if o.type != OverrideType.CHANGE else ""
        raise unknown_key_error(key, _known_keys(defaults), hint)
    in_cfg = OmegaConf.select(cfg, key, default="__missing__") != "__missing__"
    # '+key' on a key the tree has sets it: verl's tree differs between versions (a key one version lacks,
    # so that its scripts write '+', another has), and nothing is lost by taking the value the user wrote
    # 'key=value' under an open node where the key is not there yet adds it, as '+key' does: Hydra would ask for
    # the '+', but verl's scripts leave it out where verl's dataclass configs take any key (engine_kwargs.sglang.*)
    if isinstance(value, dict):
        value = check_keys(value, defaults, key + ".", f"override {o.input_line}")
    OmegaConf.update(cfg, key, value, merge=isinstance(value, dict), force_add=True)
    provided |= set(flatten(value, key + ".")) if isinstance(value, dict) and value else {key}


STR_OR_LIST = ("data.train_files", "data.val_files", "target_modules")  # keys (or last parts) taking either
NUMBER_OR_STR = ("algorithm.rollout_correction.rollout_is_threshold",)  # verl's '0.5_4.0' (lower_upper) form
FRACTIONAL = ("num_warmup_batches",)  # last parts of int-defaulted keys verl documents fractions for (1.5 batches)


def check_types(tree: dict, defaults: dict) -> list[ConfigError]:
    """A value must have its default's type (ints for floats are fine; a string for a list is wrapped).

    Returns one error per key with the wrong type (``key`` attribute set).
    """
    flat_defaults, errors = flatten(defaults), []
    for key, value in flatten(tree).items():
        default = flat_defaults.get(key)
        if default is None or value is None:
            continue
        if (key in STR_OR_LIST or key.rsplit(".", 1)[-1] in STR_OR_LIST) and isinstance(value, (str, list)):
            continue
        if key in NUMBER_OR_STR and isinstance(value, str):
            continue
        if key.rsplit(".", 1)[-1] in FRACTIONAL and isinstance(value, numbers.Real) and not isinstance(value, bool):
            continue
        ok = (isinstance(value, bool) if isinstance(default, bool)
              else isinstance(value, int) and not isinstance(value, bool) if isinstance(default, int)
              else isinstance(value, numbers.Real) and not isinstance(value, bool) if isinstance(default, float)
              else isinstance(value, str) if isinstance(default, str)
              else isinstance(value, list) if isinstance(default, list) else True)
        if not ok:
            kind = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string", "list": "a list"}
            error = ConfigError(f"{key}={value!r}: expected {kind.get(type(default).__name__, type(default).__name__)} "
                                f"(the default is {default!r})")
            error.key = key
            errors.append(error)
    return errors


def _wrap_lists(tree: dict, defaults: dict) -> dict:
    for k, v in tree.items():
        if isinstance(v, dict) and isinstance(defaults.get(k), dict):
            _wrap_lists(v, defaults[k])
        elif isinstance(v, str) and isinstance(defaults.get(k), list):
            tree[k] = [v]  # trainer.logger=console -> [console], as verl accepts
    return tree


def interpolation_deps(raw: dict) -> dict[str, list[str]]:
    """``{"a.b": "${c.d}"}`` -> ``{"a.b": ["c.d"]}``; relative ``${.x}`` is taken from the key's parent."""
    deps = {}
    for key, value in flatten(raw).items():
        if isinstance(value, str) and "${" in value:
            parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
            refs = re.findall(r"\$\{(?:oc\.select:)?([^},]+)", value)
            deps[key] = [parent + r[1:] if r.startswith(".") else r for r in refs]
    return deps


def split_groups(parsed: list, problems: list[ConfigError]) -> tuple[list, tuple[str, ...], tuple[str, ...], list[str]]:
    """Overrides -> (key overrides, verl config-group overrides, ``hydra.searchpath`` entries, notes).

    Group overrides (``model_engine=megatron``, ``actor@actor_rollout_ref.actor=megatron_actor``) and the
    search path go to Hydra's composition of verl's bundled configs; other ``hydra.*`` keys (run
    directories, job settings) configure Hydra's app, which rlflow does not run: each gets a note.
    """
    keys, groups, searchpath, notes = [], [], [], []
    for o in parsed:
        key = o.key_or_group
        if o.package is not None or key in GROUP_KEYS:
            groups.append(o.input_line.lstrip("+"))
        elif key == "hydra.searchpath":
            value = o.value()
            searchpath += value if isinstance(value, list) else [value]
        elif key == "hydra" or key.startswith("hydra."):
            notes.append(f"{o.input_line} has no effect in rlflow: it configures Hydra's app (run directories, "
                         "logging), which rlflow does not run")
        else:
            keys.append(o)
    return keys, tuple(groups), tuple(str(p) for p in searchpath), notes


def load_config(overrides: list[str] = (), config_file: str | Path | None = None, *,
                bundled: str | None = None, base_overlay: dict | None = None, trees: list[tuple[str, dict]] = (),
                problems: list[ConfigError] | None = None) -> VerlConfig:
    """Defaults <- ``base_overlay`` (not counted as set by the user) <- YAML file <- ``trees`` (named
    key trees, e.g. a translated native recipe) <- overrides; then validate keys and types and resolve.

    With ``problems`` (a list), every unknown key, bad override and wrong type is appended to it and
    the config is returned without them, so that the caller can report them with the problems of
    :func:`rlflow.config.verl.validate.validate` in one message; without it the first problem raises.
    """
    collect = problems if problems is not None else []
    defaults = default_container(DEFAULTS_FILE)  # read only
    cfg, provided = default_tree(DEFAULTS_FILE), set()
    overrides, groups, searchpath, notes = split_groups(parse_overrides(list(overrides), collect), collect)
    layers = []
    try:  # verl's --config-name ppo_megatron_trainer, model_engine=..., group@package=option
        overlay = compose_overlay(bundled or "ppo_trainer", groups, searchpath)
    except ConfigError as e:
        collect.append(e)
        overlay = {}
    if overlay:
        layers.append((f"verl's {bundled or 'ppo_trainer'} config", overlay, False))
    if base_overlay:
        layers.append(("rlflow native defaults", base_overlay, False))
    if config_file is not None:
        layers.append((str(config_file), load_yaml(Path(config_file)), True))
    layers += [(source, tree, True) for source, tree in trees]
    for source, tree, counts in layers:
        tree = check_keys(tree, defaults, source=source, problems=collect)
        cfg.merge_with(tree)
        if counts:
            provided |= set(flatten(tree))
    typed: set[str] = set()  # the keys the command line sets (a note for each that changes nothing, default or not)
    for o in overrides:
        try:
            apply_override(cfg, defaults, o, typed)
        except ConfigError as e:
            collect.append(e)
    provided |= typed
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        default_values = resolved_defaults(DEFAULTS_FILE)
    except OmegaConfBaseException as e:
        raise_problems(collect + [ConfigError(f"cannot resolve the config: {e}")])
    resolved = _wrap_lists(resolved, default_values)
    aliased, clashes = fold(resolved, provided)  # verl 0.9's reward.* onto the keys rlflow reads
    collect += [ConfigError(c) for c in clashes]
    deps = interpolation_deps(OmegaConf.to_container(cfg, resolve=False))
    type_errors = check_types(resolved, default_values)
    # a key that only repeats another (data.gen_batch_size: ${data.train_batch_size}) is reported there
    collect += [e for e in type_errors if e.key in provided or e.key not in deps]
    if problems is None:
        raise_problems(collect)
    # a key that interpolates a badly typed one (critic.ppo_mini_batch_size: ${...actor...}) is bad too
    bad = {e.key for e in type_errors}
    bad |= {k for k, refs in deps.items() if bad & set(refs)}
    cfg = VerlConfig(resolved, provided, default_values, deps, bad_keys=bad)
    cfg.notes, cfg.aliased, cfg.typed = notes, aliased, typed
    return cfg
