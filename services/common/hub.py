"""`--model` as a local checkpoint or a Hugging Face id found in the local hub cache, never downloaded.

A path that exists is the checkpoint (a directory, or only its config.json), as vLLM decides too. Anything else
shaped like a hub id (`NAME` or `ORG/NAME`) is looked up where huggingface_hub keeps its cache: $HF_HUB_CACHE,
else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub; there `models--ORG--NAME/refs/main` names the snapshot, `snapshots/REV/`. Nothing is
fetched: serving hosts have no network, so a model that is not there is an error naming the folder looked in.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from ..engine.config import CheckpointError

# huggingface_hub's rule for repo ids: an optional namespace, then a name; each 1-96 letters, digits, `_`, `-`, `.`,
# neither starting nor ending with `-` or `.` (and no `--` or `..` anywhere: is_repo_id)
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"(?:{_NAME}/)?{_NAME}", re.ASCII)
REVISION = "main"


class ModelNotFound(CheckpointError):
    """--model names neither a local checkpoint nor a snapshot in the hub cache (the message says where it looked)."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    given: str  # --model as the user wrote it
    path: str  # the checkpoint directory (or config.json) it names
    repo_id: str | None = None  # set when found in the hub cache

    @property
    def name(self) -> str:
        """The name the OpenAI API serves it under unless --served-model-name says otherwise: a hub id as given
        (vLLM serves --model as given), a local checkpoint by its directory's name."""
        if self.repo_id is not None:
            return self.repo_id
        path = os.path.normpath(self.path)
        return os.path.basename(os.path.dirname(path) if os.path.isfile(path) else path)


def hub_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """The folder huggingface_hub caches models in, by the same variables in the same order."""
    env = os.environ if env is None else env

    def expand(path: str) -> str:
        return os.path.expandvars(os.path.expanduser(path))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return expand(env[var])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(expand(home), "hub")


def is_repo_id(text: str) -> bool:
    return REPO_ID.fullmatch(text) is not None and "--" not in text and ".." not in text


def resolve_model(spec: str, env: Mapping[str, str] | None = None) -> ModelRef:
    """The checkpoint --model names; raises ModelNotFound saying where it looked."""
    if os.path.exists(spec):
        return ModelRef(spec, spec)
    if not is_repo_id(spec):
        raise ModelNotFound(f"--model {spec}: no such file or directory (and not a Hugging Face id, ORG/NAME)")
    cache = hub_cache_dir(env)
    repo = os.path.join(cache, "models--" + spec.replace("/", "--"))
    where = (f"--model {spec}: no local directory {os.path.abspath(spec)}, and the Hugging Face hub cache "
             f"{cache} (HF_HUB_CACHE, else HF_HOME/hub)")
    fill = f"; models are never downloaded at run time: fill the cache beforehand (HF_HUB_CACHE={cache} hf download {spec})"
    if not os.path.isdir(repo):
        raise ModelNotFound(f"{where} has no {os.path.basename(repo)}/{fill}")
    ref = os.path.join(repo, "refs", REVISION)
    try:
        with open(ref) as f:
            revision = f.read().strip()
    except OSError:
        snapshots = os.path.join(repo, "snapshots")
        found = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
        raise ModelNotFound(f"{where} has {repo} but no {ref} (snapshots there: {', '.join(found) or 'none'}); "
                            "to serve one snapshot, pass its directory as --model") from None
    snapshot = os.path.join(repo, "snapshots", revision)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        raise ModelNotFound(f"--model {spec}: {ref} names revision {revision!r}, but {snapshot} has no config.json "
                            f"(an interrupted download?){fill}")
    return ModelRef(spec, snapshot, spec)


def model_path(spec: str) -> str:
    """The local path of the checkpoint --model names (what the loaders read)."""
    return resolve_model(spec).path
