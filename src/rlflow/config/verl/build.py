"""Build what a verl command runs: the component tree :func:`rlflow.config.verl.tree.verl_tree` writes from its
:class:`~rlflow.config.verl.plan.Plan`, instantiated with :mod:`rlflow.config.components` -- the one path, so what
``--dry-run`` prints (``Trainer(policy=Policy.from_pretrained(...), rollout=HFRollout(...), ...)``, the Python a user
would write) is what runs. A node that fails is reported under the verl keys that set it (:func:`verl_errors`).

The prompts are loaded here too (:func:`build_data`: the tree's ``data`` node, with the policy's tokenizer and
processor, a ``data.custom_cls`` reading the files, and the verl keys' filters, notes and checks; the loops its
rows name, verl's ``agent_name``, join the agent loop).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from rlflow.config import components
from rlflow.config.verl.agent import name_loops_of_rows
from rlflow.config.verl.distillation import check_routes
from rlflow.config.verl.key_notes import unused_notes
from rlflow.config.verl.data_classes import data_node, dataset_rows
from rlflow.config.verl.folders import (TRUST, TRUST_TOKENIZER, load_vision_processor, local_model, model_files,
                                        policy_config, remote_code_errors, vision_policy)
from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.megatron import check_mtp_layers
from rlflow.config.verl.plan import Plan
from rlflow.config.verl.reward_fn import check_data_sources
from rlflow.config.verl.tree import prompts_node, verl_tree
from rlflow.data.prompts import DataError, PromptData
from rlflow.models.checks import ModelFolderError, check_model_folder, check_tokenizer
from rlflow.models.critic import Critic
from rlflow.models.hf_config import load_config
from rlflow.models.policy import Policy
from rlflow.trainer.trainer import Trainer


def load_tokenizer(plan: Plan):
    """The policy's tokenizer alone (the dry run needs no weights)."""
    from transformers import AutoTokenizer

    kw = plan.policy_kwargs
    trust = kw.get("tokenizer_trust_remote_code", kw.get("trust_remote_code", False))
    source = kw.get("tokenizer_path") or plan.model_path
    with remote_code_errors("actor_rollout_ref.model.path", TRUST_TOKENIZER):
        tok = AutoTokenizer.from_pretrained(model_files(plan)["tokenizer_path"], padding_side="left",
                                            trust_remote_code=trust)
    try:
        check_tokenizer(tok, source=source)
    except ModelFolderError as e:
        raise ConfigError(f"actor_rollout_ref.model.path: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if plan.chat_template:
        tok.chat_template = plan.chat_template
    return tok


def build_data(plan: Plan, tokenizer, processor=None) -> PromptData:
    """The tree's ``data`` node, built, then filtered once with the policy's tokenizer; the built-in reward must
    cover their sources. A ``data.custom_cls`` reads the files (with ``tokenizer`` and a vision-language policy's
    ``processor``) and its rows take their place."""
    node = prompts_node(plan, [])
    rows = {}
    if plan.dataset_cls is not None:  # data.custom_cls: the user's class reads the files; rlflow takes its rows
        config, cap = data_node(plan.cfg), {"train": "train_max_samples", "val": "val_max_samples"}
        rows = {split: dataset_rows(plan.dataset_cls, node[split], split, tokenizer, processor, config,
                                    node.get(cap[split]) or -1) if node[split] is not None else None
                for split in ("train", "val")}
        node = {k: v for k, v in node.items() if k not in rows} | {"_partial_": True}
    try:
        data = instantiate(components.resolved(node, "data"), _convert_="all")
        data = data(rows["train"], val=rows["val"]) if rows else data
    except (DataError, InstantiationException) as e:
        cause = e.__cause__ if isinstance(e, InstantiationException) else e
        if not isinstance(cause, DataError):
            raise cause from None
        raise ConfigError(f"data.train_files / data.val_files: {cause}") from cause
    try:
        data.filter_overlong(tokenizer)
    except DataError as e:
        raise ConfigError(f"data.train_files / data.val_files: {e}") from e
    if not plan.custom_reward and plan.reward.functions:  # the built-in scorers must know every data_source
        check_data_sources({r["data_source"] for r in data.train + data.val}, f"{data.train_name}")
    check_routes(plan.distillation, {r["data_source"] for r in data.train + data.val}, data.train_name)
    name_loops_of_rows(plan.agent, [(data.train_name, r) for r in data.train] + [(data.val_name, r) for r in data.val])
    return data


def total_steps(plan: Plan, data: PromptData) -> int:
    """verl's rule: ``trainer.total_training_steps`` if set, else epochs x (prompts // train_batch_size)."""
    batch = plan.trainer_kwargs["batch_size"]
    if batch > len(data.train):
        raise ConfigError(f"data.train_batch_size={batch} > {len(data.train)} training prompts in {data.train_name}")
    return plan.total_training_steps or plan.total_epochs * (len(data.train) // batch)


# a node of the tree -> (the verl key its model folder is at, its trust key, its override key)
MODEL_NODES = {"policy": ("actor_rollout_ref.model.path", f"{TRUST}=True", "actor_rollout_ref.model.override_config"),
               "critic": ("critic.model.path", "critic.model.trust_remote_code=True", "critic.model.override_config"),
               "reference": ("actor_rollout_ref.ref.model", f"{TRUST}=True", None)}
# a node of the tree -> the verl keys that set its arguments (named when its constructor refuses them)
NODE_KEYS = {"rollout": "actor_rollout_ref.rollout.*", "loss": "actor_rollout_ref.actor.*", "estimator": "algorithm.*",
             "reward": "reward_model.* / custom_reward_function.*", "stages": "algorithm.* / distillation.*",
             "value_loss": "critic.cliprange_value / critic.loss_agg_mode", "teacher": "distillation.*"}


@contextmanager
def verl_errors():
    """A tree node's failure as the verl entry point reported it: a model folder's problems under its key, a
    constructor's refusal naming the keys that set its arguments; anything else as it was raised."""
    try:
        yield
    except InstantiationException as e:
        cause = e
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        where = re.search(r"full_key: ([\w.\[\]]+)", str(e))
        root = re.split(r"[.\[]", where.group(1))[0] if where else ""
        if root in MODEL_NODES:
            path_key, trust, override = MODEL_NODES[root]
            if isinstance(cause, ModelFolderError) or (root == "reference" and isinstance(cause, ValueError)):
                raise ConfigError(f"{path_key}: {cause}") from None
            with remote_code_errors(path_key, trust, override):
                raise cause from None
        if root in NODE_KEYS and isinstance(cause, (ValueError, TypeError)):
            raise ConfigError(f"{NODE_KEYS[root]}: {str(e).split(chr(10) + 'full_key')[0]}") from cause
        raise cause from None


def check_models(plan: Plan) -> None:
    """What the verl entry point checks of the policy's folder before the tree is built (no weights read)."""
    config = policy_config(plan)
    vision = getattr(config, "vision_config", None) is not None
    check_mtp_layers(plan, config)
    if plan.vision and not vision:
        raise ConfigError(f"actor_rollout_ref.rollout.enable_vision=True but actor_rollout_ref.model.path="
                          f"{plan.model_path} is not an image-text-to-text model (its config has no vision_config)")
    if vision and not getattr(plan.rollout_cls, "makes_image_engine", False):
        raise ConfigError(
            f"actor_rollout_ref.rollout.name: {plan.model_path} is a vision-language model, but "
            f"{plan.rollout_cls.__name__} takes no images yet (vLLM's multimodal input path builds the model's "
            "transformers AutoProcessor, whose Qwen2-VL video processor needs torchvision, which rlflow's CPU "
            "install removes); set actor_rollout_ref.rollout.name=hf")
    folders = {"actor_rollout_ref.model.path": plan.model_path, "critic.model.path": plan.critic_path,
               "actor_rollout_ref.ref.model": plan.ref_model_path}
    for key, path in folders.items():
        try:
            if path is not None:
                check_model_folder(local_model(path, key), tokenizer=False)
        except ModelFolderError as e:
            raise ConfigError(f"{key}: {e}") from None
    if plan.ref_model_path is not None:  # it scores the policy's token ids
        key = "actor_rollout_ref.ref.model"
        with remote_code_errors(key, f"{TRUST}=True"):
            config = load_config(local_model(plan.ref_model_path, key), None,
                                 plan.policy_kwargs.get("trust_remote_code", False))
        ours, theirs = (c.get_text_config().vocab_size for c in (policy_config(plan), config))
        if ours != theirs:
            raise ConfigError(f"{key}={plan.ref_model_path}: its vocabulary has {theirs} tokens, the policy's "
                              f"({plan.model_path}) {ours}; the reference scores the policy's token ids, so they "
                              "must agree")


def check_teachers(plan: Plan, trainer: Trainer) -> None:
    """Distillation feeds the student's token ids to the teachers as they are: one vocabulary."""
    vocab = trainer.policy.tokenizer.get_vocab()
    for stage in trainer.experience.stages:
        for route, tokenizer in getattr(stage, "tokenizers", {}).items():
            if tokenizer.get_vocab() != vocab:
                teachers = plan.distillation["teachers"]
                teacher = teachers if "key" in teachers else teachers[route]
                raise ConfigError(f"{teacher['key']}={teacher['path']}: the teacher's tokenizer differs from the "
                                  f"student's ({plan.model_path}); distillation needs one vocabulary")


def build_tree(plan: Plan, total: int, *, root: str | None = None):
    """Build the tree :func:`rlflow.config.verl.tree.verl_tree` writes for ``plan`` (the one path: what the dry run
    prints is what runs), or only its node ``root`` (``"policy"``, ``"critic"``, ``"reward"``)."""
    made = verl_tree(plan, total)
    with verl_errors():
        if root is None:
            return components.build_trainer(made.tree)
        return instantiate(components.resolved(made.tree[root], root), _convert_="all")


def build_policy(plan: Plan) -> Policy:
    """The tree's ``policy`` node, built (a total of 1 step: the policy does not depend on it)."""
    check_models(plan)
    return build_tree(plan, 1, root="policy")


def build_critic(plan: Plan) -> Critic:
    """The tree's ``critic`` node, built."""
    check_models(plan)
    return build_tree(plan, 1, root="critic")


def build_reward(plan: Plan):
    """The tree's ``reward`` node, built: functions, a reward model or both, shaped by ``OverlongPenalty`` when
    the DAPO reward manager asks for it."""
    return build_tree(plan, 1, root="reward")


def build_estimator(plan: Plan, *_) -> tuple:
    """The tree's ``estimator`` node (a ``Chain`` with the modules around it) and ``stages``, built; the stages that
    generate or score (``GreedyBaseline()``, a teacher) take the run's own rollout and reward from the Trainer."""
    made = verl_tree(plan, 1).tree
    with verl_errors():
        return tuple(instantiate(components.resolved(made.get(root, []), root), _convert_="all")
                     for root in ("estimator", "stages"))


def build_trainer(plan: Plan, data: PromptData | None = None) -> tuple[Trainer, PromptData]:
    """The Trainer of this plan, built from its component tree, and the prompts (loaded here unless given, with the
    policy's tokenizer and processor: the tree's ``data`` node plus the verl keys' filters and checks)."""
    check_models(plan)
    data = data or build_data(plan, load_tokenizer(plan), load_vision_processor(plan))
    trainer = build_tree(plan, total_steps(plan, data))
    if plan.distillation is not None:
        check_teachers(plan, trainer)
    return trainer, data


def run_notes(plan: Plan, data: PromptData, trainer: Trainer | None = None) -> list[str]:
    """Every note of a run, in the order printed: the plan's (about the keys), what building the ``trainer`` (when
    given) and loading ``data`` found, and last the keys that change nothing (building reads keys too)."""
    found = (model_notes(plan) if trainer is not None else []) + data_notes(plan, data)
    if trainer is not None and plan.ref_model_path is not None and trainer.reference is None:
        found.append(f"actor_rollout_ref.ref.model={plan.ref_model_path} has no effect: nothing in this run reads "
                     "reference log-probs (no KL loss or KL in the reward)")
    return [*plan.notes, *found, *unused_notes(plan.cfg)]


def model_notes(plan: Plan) -> list[str]:
    """What :func:`check_models` lets through with a note."""
    if plan.policy_kwargs.get("freeze_vision_tower") and not vision_policy(plan):
        return [f"actor_rollout_ref.actor.freeze_vision_tower=True: {plan.model_path} is a text model, so there is "
                "no vision tower to freeze"]
    return []


def data_notes(plan: Plan, data: PromptData) -> list[str]:
    """What :func:`build_data` dropped or could not use."""
    notes = []
    if data.processor is None and data.mm_processor_kwargs:
        notes.append(f"data.mm_processor_kwargs={data.mm_processor_kwargs!r} has no effect: "
                     f"{plan.model_path} has no processor (not a vision-language model)")
    if any(data.skipped_images.values()):
        notes.append(f"data.bad_images=skip: dropped {data.skipped_images['train']} training and "
                     f"{data.skipped_images['val']} validation row(s) with a missing or corrupt image")
    if any(data.skipped.values()):
        notes.append(f"data.missing_ground_truth=skip: dropped {data.skipped['train']} training and "
                     f"{data.skipped['val']} validation row(s) without reward_model.ground_truth")
    dropped = data.filtered or {}  # data.filter_overlong's counts
    if any(dropped.values()):
        notes.append(f"data.filter_overlong_prompts: dropped {dropped['train']} training and {dropped['val']} "
                     f"validation prompt(s) longer than max_prompt_length={data.max_prompt_length} tokens")
    return notes
