"""Model resolution: what the user typed → an MLX model folder on disk.

Accepted: a local MLX folder; a ``.gguf`` file (converted once into the cache
directory); a Hugging Face repo id (from the local hub cache, or downloaded);
the family name ``mlx-community/DeepSeek-R1-Distill`` (the largest 4-bit
distill that fits this machine's memory); nothing (the offline demo model,
SmolLM2-135M-Instruct). ``HF_HUB_OFFLINE``, ``HF_HOME`` and ``HF_HUB_CACHE`` are
read at call time.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from .demo_model import demo_model_path
from .errors import MlxEvictError
from .family import (  # noqa: F401 (their old import path)
    DEEPSEEK_R1_DISTILL,
    FAMILY_NAME,
    FamilyMember,
    choose_family_member,
    is_family_name,
)
from .geometry import read_config
from .folder_check import check_address_space, check_files, redo_hint
from .model_patch import SUPPORTED_ARCHITECTURES

DEMO_NAME = "demo"
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

Report = Callable[[str], None]


@dataclass(frozen=True)
class Resolved:
    """A model folder and how it was found.

    Attributes:
        path: the MLX model folder (``config.json`` + weights + tokenizer).
        name: what to show the user (repo id, file or folder name).
        source: ``"folder"``, ``"gguf"``, ``"hub"``, ``"family"`` or ``"demo"``.
        reason: why this model (family choice), else ``""``.
        weights_nbytes: the weights' size when ``path`` holds none yet (an unconverted GGUF's plan).
    """

    path: Path
    name: str
    source: str
    reason: str = ""
    weights_nbytes: Optional[int] = None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as ``huggingface_hub`` finds it, read from the environment now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface").expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def cached_repos() -> list[str]:
    """Model repo ids in the local hub cache (``models--org--name`` folders)."""
    root = hub_cache_dir()
    if not root.is_dir():
        return []
    return sorted(d.name[len("models--") :].replace("--", "/", 1) for d in root.glob("models--*--*"))


def _repo_dir(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def cached_snapshot(repo: str, *, weights: bool = True) -> Optional[Path]:
    """The snapshot folder of ``repo``'s ``main`` in the hub cache, if it holds a usable model."""
    ref = _repo_dir(repo) / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = _repo_dir(repo) / "snapshots" / ref.read_text().strip()
    if not (snapshot / "config.json").is_file():
        return None
    if weights and not any(snapshot.glob("*.safetensors")):
        return None
    return snapshot


# ---- suggestions ------------------------------------------------------------------
def known_names() -> list[str]:
    return [FAMILY_NAME, DEMO_NAME, *(m.repo for m in DEEPSEEK_R1_DISTILL), *cached_repos()]


def suggest(name: str) -> str:
    """`` (did you mean X?)`` for the closest known model name, or ``""``."""
    names = known_names()
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    if not close:
        # A bare model name ("deepseek-r1-distil") is compared with the part after the org.
        tails = {n.split("/")[-1].lower(): n for n in names}
        close = [tails[c] for c in difflib.get_close_matches(name.lower(), list(tails), n=1, cutoff=0.6)]
        return f" (did you mean {close[0]}?)" if close else ""
    return f" (did you mean {by_lower[close[0]]}?)"


# ---- the hub ------------------------------------------------------------------------
def hub_snapshot(repo: str, *, weights: bool = True, progress: bool = False) -> Path:
    """The local folder of a hub repo: from the cache, else downloaded (with a progress bar).

    Args:
        repo: ``org/name``.
        weights: fetch the weights too; ``False`` fetches only the JSON files (``info``).
        progress: show ``huggingface_hub``'s progress bars on stderr.

    Raises:
        MlxEvictError: offline and not cached (names the repo and how to fetch it),
            unknown repo (suggests the closest known name), or a network failure.
    """
    cached = cached_snapshot(repo, weights=weights)
    if cached is not None:
        return cached
    how = f"fetch it with `hf download {repo}` on a machine with network access (same HF_HOME)"
    if hub_offline():
        raise MlxEvictError(
            f"{repo} is not in the local hub cache ({hub_cache_dir()}) and HF_HUB_OFFLINE is set; {how}{suggest(repo)}"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    patterns = ALLOW_PATTERNS if weights else ["*.json"]
    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = snapshot_download(repo, cache_dir=hub_cache_dir(), allow_patterns=patterns)
    except GatedRepoError:
        raise MlxEvictError(
            f"{repo} is gated on Hugging Face: accept its licence on the website and run `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise MlxEvictError(f"no model {repo!r} on Hugging Face{suggest(repo)}") from None
    except LocalEntryNotFoundError:
        raise MlxEvictError(f"cannot reach Hugging Face to download {repo} and it is not cached; {how}") from None
    except OSError as err:
        raise MlxEvictError(f"downloading {repo} failed: {err}") from None
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
    return Path(path)


def hub_weights_nbytes(repo: str) -> Optional[int]:
    """Download size of a repo's ``*.safetensors`` without downloading (``None`` offline or on failure)."""
    if hub_offline():
        return None
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except Exception:  # informational only: a failure leaves the size unknown, and info says so
        return None
    sizes = [s.size or 0 for s in info.siblings or [] if s.rfilename.endswith(".safetensors")]
    return sum(sizes) if sizes else None


# ---- GGUF -------------------------------------------------------------------------
def _convert_gguf(gguf: Path, dtype: Optional[str], progress: bool, report: Optional[Report]) -> Path:
    """The cached conversion of ``gguf``, converting it now (said on stderr, with a bar on a terminal)."""
    from .gguf_cache import convert_once

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=gguf.stat().st_size, unit="B", unit_scale=True, desc="convert", file=sys.stderr)

    def advance(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        return convert_once(gguf, dtype=dtype, progress=advance if bar else None, report=report or _say)
    finally:
        if bar:
            bar.close()


def _say(line: str) -> None:
    print(f"mlxevict: {line}", file=sys.stderr, flush=True)


def _gguf_plan(gguf: Path, dtype: Optional[str]) -> "Resolved":
    """A GGUF for a memory plan: its conversion if cached, else its header's config (nothing converted)."""
    from .gguf_cache import cached_conversion, plan_folder

    folder = cached_conversion(gguf, dtype)
    if folder is not None:
        return Resolved(folder, gguf.name, "gguf")
    folder, nbytes = plan_folder(gguf)
    reason = "not converted yet: planned from the GGUF header (generate or chat converts it once)"
    return Resolved(folder, gguf.name, "gguf", reason, weights_nbytes=nbytes)


# ---- the one entry point ------------------------------------------------------------
def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or os.sep in name and not _REPO_ID.match(name)


def resolve_model(
    name: Optional[str] = None,
    *,
    memory: Optional[int] = None,
    weights: bool = True,
    progress: bool = False,
    gguf_dtype: Optional[str] = None,
    report: Optional[Report] = None,
    budget: Any = None,
) -> Resolved:
    """Find (and if needed fetch or convert) the model folder for what the user typed.

    Args:
        name: a folder, a ``.gguf`` file, ``org/name``, the family name
            ``mlx-community/DeepSeek-R1-Distill``, ``"demo"`` or ``None`` (the demo model).
        memory: total memory for the family choice, for a machine of that size with the usual apps
            open; default this machine's total and what it has available now.
        weights: ``False`` fetches only a hub repo's JSON files and converts no GGUF (enough for a memory plan).
        progress: show download and conversion progress bars on stderr.
        gguf_dtype: ``None`` keeps a GGUF's tensors as stored; ``"float16"``/``"float32"`` dequantizes.
        report: called with one human line for each decision worth telling (the family choice).
        budget: the ``--budget`` the model will run with, for the family choice (default 2048 tokens).

    Returns:
        A :class:`Resolved`.

    Raises:
        MlxEvictError: unknown or misspelt name (with a suggestion), offline and
            not cached, a missing path, a folder that is not an MLX model.
    """
    if name is None or name.strip() == "" or name.strip().lower() == DEMO_NAME:
        return Resolved(Path(demo_model_path()), "SmolLM2-135M-Instruct (demo)", "demo")
    name = name.strip()
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MlxEvictError(
                f"{path} is a folder but not an MLX model (no config.json); convert a model into it first"
            )
        return Resolved(path, path.name, "folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise MlxEvictError(
                f"{path} is a file but not a .gguf model; give a .gguf file, an MLX folder or a repo id"
            )
        if not weights:
            return _gguf_plan(path, gguf_dtype)
        return Resolved(_convert_gguf(path, gguf_dtype, progress, report), path.name, "gguf")
    if _looks_like_path(name):
        raise MlxEvictError(f"{name}: no such file or folder{suggest(name)}")
    if is_family_name(name):
        system = psutil.virtual_memory()
        total, available = (memory, None) if memory else (system.total, system.available)
        cached = [m.repo for m in DEEPSEEK_R1_DISTILL if cached_snapshot(m.repo, weights=weights)]
        member, reason = choose_family_member(
            total, cached=cached if hub_offline() else (), available=available, budget=budget
        )
        if report:
            report(reason)
        return Resolved(hub_snapshot(member.repo, weights=weights, progress=progress), member.repo, "family", reason)
    if not _REPO_ID.match(name):
        raise MlxEvictError(
            f"unknown model {name!r}{suggest(name)}: give an MLX folder, a .gguf file, "
            f"a Hugging Face repo id (org/name) or {FAMILY_NAME}"
        )
    return Resolved(hub_snapshot(name, weights=weights, progress=progress), name, "hub")


def check_architecture(path: Path) -> dict[str, Any]:
    """Read the folder's ``config.json`` and refuse an architecture mlxevict cannot evict for."""
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise MlxEvictError(
            f"architecture {model_type!r} ({path / 'config.json'}) is not supported by mlxevict; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config


def load_model(resolved: Resolved) -> tuple[Any, Any]:
    """``mlx_lm.load`` the folder after checking its architecture and files; return ``(model, tokenizer)``."""
    check_architecture(resolved.path)
    check_files(resolved)
    check_address_space(resolved.path, resolved.name)
    from mlx_lm import load

    try:
        return load(str(resolved.path))
    except (ValueError, FileNotFoundError, OSError) as err:
        raise MlxEvictError(f"cannot load {resolved.name} from {resolved.path}: {err}") from None
    except RuntimeError as err:  # MLX's reader: "[load_safetensors] ..." on a damaged file
        raise MlxEvictError(f"cannot read the weights in {resolved.path} ({err}); {redo_hint(resolved)}") from None
