"""Replaying dumped rollouts: iterate on training without generating again (verl's ``skip.*`` / ``skip_rollout``).

:class:`ReplayRollout` wraps a rollout. The first run with a dump folder generates as usual and writes each
generation round's samples there; a later run with the same folder and settings loads them instead of
generating. The folder holds rlflow's own format::

    dump_dir/manifest.json          {"format": "rlflow-rollout-dump", "version": 1, "settings": {...}}
    dump_dir/<round>/rank<r>/meta.json   {"round": k, "processes": N, "prompts_sha256": "..."}
    dump_dir/<round>/rank<r>/samples/    process r's samples of the round, a TensorDict saved by tensordict's memmap

``settings`` is the fingerprint of what generated the samples (model, sampling settings, batch size: the caller's,
plus the rollout's ``n``, ``temperature`` and ``max_new_tokens``); a run with other settings is refused naming
what differs, and so is a round whose prompts differ from the dumped round's (``action="cache"``). A folder
verl wrote (pickled ``DataProto`` objects) is refused saying so. Rounds count the training calls of the
rollout from 1 (one per step; several with dynamic sampling); validation (``with_options``) is never replayed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rollout.ranks import ranks
from rlflow.rollout.wrapper import RolloutWrapper

FORMAT, VERSION = "rlflow-rollout-dump", 1
ACTIONS = ("cache", "repeat")
VERL_FILES = ("gen_batch.dp", "tq_batch.pt", "*.pkl")  # verl's RolloutSkip (skip.*) and rollout_skip dumps


class ReplayRollout(RolloutWrapper):
    """``rollout``, with each round's samples dumped to ``dump_dir`` the first time and replayed from it after.

    ``rounds``: the rounds to dump and replay (verl's ``steps``; ``None``: every round); the others generate.
    ``action``: ``"cache"`` replays round k from round k's dump (its prompts must be the same) and generates and
    dumps a round with no dump yet; ``"repeat"`` replays the nearest dumped round (the latest before k, else the
    first after it), whatever its prompts, and generates only while the folder holds none.
    """

    def __init__(self, rollout, dump_dir: str | Path, settings: dict[str, Any] | None = None,
                 rounds: Collection[int] | None = None, action: str = "cache"):
        super().__init__(rollout)
        if action not in ACTIONS:
            raise ValueError(f"ReplayRollout: action={action!r}; expected one of {ACTIONS}")
        self.dump_dir, self.rounds, self.action = Path(dump_dir).expanduser(), rounds, action
        self.settings = {**(settings or {}), "n": rollout.n, "temperature": rollout.temperature,
                         "max_new_tokens": rollout.max_new_tokens}
        self.round, self._stats = 0, {}
        self._check_folder()

    @property
    def stats(self) -> dict[str, float]:
        """``replay/replayed`` (1: this round was replayed), with the wrapped rollout's stats when it generated."""
        if self._stats.get("replay/replayed"):
            return dict(self._stats)
        return dict(getattr(self.rollout, "stats", None) or {}) | self._stats

    # ------------------------------------------------------------------ the folder
    def _check_folder(self) -> None:
        verl = [p for pattern in VERL_FILES for p in self.dump_dir.rglob(pattern)] if self.dump_dir.is_dir() else []
        manifest = self.dump_dir / "manifest.json"
        if verl and not manifest.is_file():
            raise ValueError(f"ReplayRollout: {self.dump_dir} holds rollouts verl dumped ({verl[0]}: a pickled verl "
                             "DataProto, which needs verl to read); rlflow replays only dumps it wrote itself. Point "
                             "the dump folder at a new folder: the first run there generates and dumps")
        if not manifest.is_file():
            return
        meta = json.loads(manifest.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"ReplayRollout: {manifest} is not an rlflow rollout dump (format "
                             f"{meta.get('format')!r}, expected {FORMAT!r})")
        dumped = meta.get("settings", {})
        differ = {k: (dumped.get(k), v) for k, v in self.settings.items() if _plain(v) != dumped.get(k)}
        differ |= {k: (v, None) for k, v in dumped.items() if k not in self.settings}
        if differ:
            what = "; ".join(f"{k}: dumped {a!r}, now {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"ReplayRollout: the rollouts in {self.dump_dir} were generated with other settings "
                             f"({what}); replaying them would train on samples this run would not draw. Use another "
                             "dump folder, or the dumped run's settings")

    def _round_dir(self, k: int, rank: int | None = None) -> Path:
        """This process's folder of round ``k`` (or process ``rank``'s)."""
        return self.dump_dir / str(k) / f"rank{ranks()[0] if rank is None else rank}"

    def _dumped(self) -> list[int]:
        found = [int(p.name) for p in self.dump_dir.glob("*") if p.name.isdigit()
                 and (p / "rank0" / "meta.json").is_file()]
        return sorted(found)

    # ------------------------------------------------------------------ generating or replaying
    def forward(self, prompts: TensorDict) -> TensorDict:
        self.round += 1
        k = self.round
        if self.rounds is not None and k not in self.rounds:
            self._stats = {"replay/replayed": 0.0}
            return self.rollout(prompts)
        source = self._source(k)
        if source is None:
            samples = self.rollout(prompts)
            self._dump(k, prompts, samples)
            self._stats = {"replay/replayed": 0.0}
            return samples
        self._stats = {"replay/replayed": 1.0, "replay/round": float(source)}
        return self._load(source, prompts, check_prompts=self.action == "cache")

    def _source(self, k: int) -> int | None:
        if (self._round_dir(k, 0) / "meta.json").is_file():
            return k
        dumped = self._dumped() if self.action == "repeat" else []
        before = [r for r in dumped if r < k]
        return before[-1] if before else (dumped[0] if dumped else None)

    def _dump(self, k: int, prompts: TensorDict, samples: TensorDict) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        manifest = self.dump_dir / "manifest.json"
        rank, world = ranks()
        if rank == 0 and not manifest.is_file():
            manifest.write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                            "settings": {k_: _plain(v) for k_, v in self.settings.items()}}, indent=1))
        folder = self._round_dir(k)
        samples.detach().to("cpu").memmap(folder / "samples")
        (folder / "meta.json").write_text(json.dumps({"round": k, "processes": world,
                                                      "prompts_sha256": prompts_digest(prompts)}))

    def _load(self, k: int, prompts: TensorDict, check_prompts: bool) -> TensorDict:
        folder, world = self._round_dir(k), ranks()[1]
        dumped = json.loads((self._round_dir(k, 0) / "meta.json").read_text())["processes"]
        if dumped != world or not (folder / "meta.json").is_file():
            raise ValueError(f"ReplayRollout: round {k} in {self.dump_dir} was dumped by {dumped} training "
                             f"process(es), this run has {world}: each process replays its own share")
        meta = json.loads((folder / "meta.json").read_text())
        if check_prompts and meta["prompts_sha256"] != prompts_digest(prompts):
            raise ValueError(f"ReplayRollout: round {k} (step {k} without dynamic sampling) has other prompts than "
                             f"the round dumped in {folder}: its samples answer other prompts (another data order, "
                             "batch size or data file, or a resumed run: rounds count from 1 in every run)")
        device = prompts.get(K.PROMPT_IDS).device
        return TensorDict.load_memmap(folder / "samples").clone().to(device)


def prompts_digest(prompts: TensorDict) -> str:
    """sha256 of the prompt token ids and mask (the prompts the samples answer)."""
    digest = hashlib.sha256()
    for key in (K.PROMPT_IDS, K.PROMPT_MASK):
        value = prompts.get(key).detach().to("cpu", torch.int64).contiguous()
        digest.update(str(tuple(value.shape)).encode() + value.numpy().tobytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), so a manifest compares equal to its settings."""
    return json.loads(json.dumps(value, default=str))
