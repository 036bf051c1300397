"""Where a model comes from: a diffusers folder, or a Hugging Face repo id (`org/name`, optionally `@revision`)
resolved through huggingface_hub's own cache — the folder most users already have — downloading the diffusers
layout alone when the machine is online, and saying exactly what to download when it is not."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from lorakit.errors import EnvironmentFault, InputError
from lorakit.events import Events
from lorakit.models import single_file
from lorakit.models.registry import family_of_folder

_REPO = re.compile(r"^[^/\s@~]+/[^/\s@]+(@\S+)?$")  # looks like org/name[@revision]; the rules: check_repo_id
# the diffusers layout: model_index.json and the component folders (a repo's top-level single-file checkpoints,
# e.g. FLUX.1-dev's 23 GB flux1-dev.safetensors, are not needed)
PATTERNS = ["model_index.json", "*/*"]


_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]+/?$")


def repo_of_snapshot(path) -> str | None:
    """The repo id of a folder in the hub's cache (models--org--name/snapshots/<commit>), else None."""
    m = _SNAPSHOT.search(str(path))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def is_repo_id(text: str) -> bool:
    """Shaped like `org/name` or `org/name@revision`, and no such local path: taken as a repo id (whose characters
    `check_repo_id` then checks)."""
    return bool(_REPO.match(text)) and not text.startswith(("./", "../")) and not Path(text).exists()


def check_repo_id(spec: str, key: str = "model.path") -> tuple[str, str]:
    """(repo, revision) of `org/name[@revision]`, checked by huggingface_hub's own rules (1-96 characters of
    letters, digits, '-', '_', '.'; no '--' or '..'; not starting or ending with '-' or '.').

    Raises:
        InputError: naming the rule broken (no such local folder either).
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, _, rev = spec.partition("@")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        rule = str(e).split(":")[0].rstrip(".")
        raise InputError(f"{key}: {spec} is no folder here, and not a Hugging Face repo id either ({rule})",
                         "give the diffusers model folder's path, or an id such as black-forest-labs/FLUX.1-dev") \
            from None
    if rev and not re.fullmatch(r"[\w./-]{1,200}", rev):
        raise InputError(f"{key}: {spec}: @{rev} is not a branch, tag or commit name",
                         "letters, digits, '.', '_', '-', '/' after the @")
    return repo, rev


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def model_from_hub(spec: str, without: tuple[str, ...] = (), key: str = "model.path") -> Path:
    """The local snapshot folder of a repo id (downloaded when online and missing).

    Args:
        without: component folders whose weights are not downloaded (a single file's base: its transformer's;
            its config.json is).
        key: the config key that named it (for messages).

    Raises:
        InputError: no such repo or revision; offline and not in the cache (naming the download command).
        EnvironmentFault: the hub could not be reached, or the disk filled.
    """
    from huggingface_hub import errors as hfe
    from huggingface_hub import snapshot_download

    repo, rev = check_repo_id(spec, key)
    get = f"hf download {repo}" + (f" --revision {rev}" if rev else "") + " --include 'model_index.json' '*/*'" \
        + "".join(f" --exclude '{w}/*.safetensors*'" for w in without)
    try:
        return Path(snapshot_download(repo, revision=rev or None, allow_patterns=PATTERNS,
                                      ignore_patterns=[f"{w}/*.safetensors*" for w in without] or None,
                                      local_files_only=offline()))
    except (hfe.RepositoryNotFoundError, hfe.GatedRepoError) as e:
        gated = isinstance(e, hfe.GatedRepoError)
        raise InputError(f"{key}: {repo} is {'a gated repository' if gated else 'not a repository'} on the "
                         "Hugging Face Hub" + (" (its licence must be accepted first)" if gated else ""),
                         "accept the licence on the model's page and `hf auth login`" if gated else
                         "check the name (org/name), or give the diffusers model folder") from None
    except hfe.RevisionNotFoundError:
        raise InputError(f"{key}: {repo} has no revision {rev!r}",
                         "a branch, tag or commit of the repository, or leave @revision out") from None
    except (hfe.LocalEntryNotFoundError, hfe.IncompleteSnapshotError) as e:
        cache = hub_cache()
        free = _free_gib(cache)
        why = ("downloads are off (HF_HUB_OFFLINE=1)" if offline() else f"the hub could not be reached ({e})")
        raise InputError(f"{key}: {spec} is no folder here, and as a Hugging Face repo id it is not (completely) "
                         f"in the hub's cache {cache} and {why}",
                         f"download it on a machine with network access: {get} ({free} GiB free in {cache}; "
                         "FLUX.1-dev takes ~34 GB, Qwen-Image ~58 GB)") from None
    except OSError as e:
        raise EnvironmentFault(f"{key}: {spec}: the download into {hub_cache()} failed: {e}",
                               f"free space there, or download it yourself: {get}") from None


def _free_gib(folder: Path) -> str:
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"{shutil.disk_usage(p).free / 2**30:.0f}"
    except OSError:
        return "?"


def model_folder(path, base: str | None, family: str | None = None, events: Events | None = None,
                 keys: tuple[str, str] = ("model.path", "model.base")) -> tuple[Path, list[str]]:
    """What model.path names, as a diffusers model folder: the folder itself, a repo id's snapshot in the hub's
    cache, or a single-file checkpoint made into a folder with model.base's other components.

    Args:
        keys: how the user named the model and its base (config keys, or the CLI's MODEL and --base).

    Returns:
        (the folder, notes saying how it was found).

    Raises:
        InputError: a single file without a base; see `model_from_hub` and `single_file.compose`.
    """
    text, notes = str(path), []
    if is_repo_id(text):
        folder = model_from_hub(text, key=keys[0])
        return folder, [f"{keys[0]}: {text} is {folder} (the Hugging Face cache)"]
    if not single_file.is_single_file(path):
        if base:
            notes.append(f"{keys[1]}: {base} is not used (it goes with a single-file {keys[0]}; {path} is not one)")
        return Path(path), notes
    example = "--set model.base=" if keys[1] == "model.base" else f"{keys[1]} "
    if not base:
        raise InputError(f"{keys[0]}: {path} is a single-file checkpoint; its text encoders, VAE and scheduler come "
                         f"from the model it was made from: name it with {keys[1]}",
                         f"e.g. {example}black-forest-labs/FLUX.1-dev (a repo id: only its other components are "
                         "downloaded) or the downloaded folder")
    base_dir = model_from_hub(base, without=("transformer",), key=keys[1]) if is_repo_id(base) else Path(base)
    if not base_dir.is_dir():
        raise InputError(f"{keys[1]}: no such folder: {base_dir}",
                         "a diffusers model folder (model_index.json inside) or a Hugging Face repo id")
    return single_file.compose(path, base_dir, family or family_of_folder(base_dir), events)
