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
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from .defaults import FAMILY_NAME
from .demo_model import cache_dir, demo_model_path
from .errors import MlxEvictError
from .patch import SUPPORTED_ARCHITECTURES
from .telemetry import format_bytes, read_config

DEMO_NAME = "demo"
USEFUL_BUDGET = 4096  # KV entries a reasoning model needs to think usefully with eviction
OVERHEAD_BYTES = 1 * 1000**3  # tokenizer, the Python process, prefill buffers
OVERHEAD_SHARE = 0.10  # activations and MLX's buffer cache grow with the model
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")

Report = Callable[[str], None]


@dataclass(frozen=True)
class FamilyMember:
    """One 4-bit mlx-community DeepSeek-R1-Distill repo, with what sizing needs to know."""

    repo: str
    params: str  # "7B"
    base: str  # "Qwen" or "Llama"
    weights_gb: float  # approximate download size, 10^9 bytes
    layers: int
    kv_heads: int
    head_dim: int = 128
    dtype_size: int = 2  # bfloat16 activations
    context: int = 131072

    @property
    def weights_nbytes(self) -> int:
        return int(self.weights_gb * 1000**3)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_size

    @property
    def overhead_nbytes(self) -> int:
        return OVERHEAD_BYTES + int(OVERHEAD_SHARE * self.weights_nbytes)

    @property
    def need_nbytes(self) -> int:
        """Weights + a :data:`USEFUL_BUDGET` KV cache + overhead."""
        return self.weights_nbytes + USEFUL_BUDGET * self.kv_bytes_per_token + self.overhead_nbytes


# Smallest first. Layer counts and kv-heads are the models' config.json values.
DEEPSEEK_R1_DISTILL: tuple[FamilyMember, ...] = (
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit", "1.5B", "Qwen", 1.0, layers=28, kv_heads=2),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-7B-4bit", "7B", "Qwen", 4.3, layers=28, kv_heads=4),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit", "8B", "Llama", 4.5, layers=32, kv_heads=8),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-14B-4bit", "14B", "Qwen", 8.3, layers=48, kv_heads=8),
    FamilyMember("mlx-community/DeepSeek-R1-Distill-Qwen-32B-4bit", "32B", "Qwen", 18.4, layers=64, kv_heads=8),
)


@dataclass(frozen=True)
class Resolved:
    """A model folder and how it was found.

    Attributes:
        path: the MLX model folder (``config.json`` + weights + tokenizer).
        name: what to show the user (repo id, file or folder name).
        source: ``"folder"``, ``"gguf"``, ``"hub"``, ``"family"`` or ``"demo"``.
        reason: why this model (family choice), else ``""``.
    """

    path: Path
    name: str
    source: str
    reason: str = ""


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


# ---- the family name ------------------------------------------------------------
def is_family_name(name: str) -> bool:
    return name.strip().rstrip("/").lower() in {FAMILY_NAME.lower(), FAMILY_NAME.split("/")[1].lower()}


def choose_family_member(memory: int, *, cached: Sequence[str] = ()) -> tuple[FamilyMember, str]:
    """The largest DeepSeek-R1-Distill 4-bit repo whose weights + a useful KV budget fit ``memory``.

    A model may use about 2/3 of memory up to 36 GB and 3/4 above (macOS's GPU
    working-set limit; the rest stays with the system). When ``cached`` is given
    (offline), the largest fitting repo among those is chosen and the reason says
    which larger one was skipped.

    Args:
        memory: the machine's total memory in bytes.
        cached: repo ids available locally; empty means any may be downloaded.

    Returns:
        ``(member, reason)``.

    Raises:
        MlxEvictError: not even the smallest fits (or none that fits is cached).
    """
    usable = memory * (2 / 3 if memory <= 36 * 1024**3 else 3 / 4)
    fitting = [m for m in DEEPSEEK_R1_DISTILL if m.need_nbytes <= usable]
    if not fitting:
        smallest = DEEPSEEK_R1_DISTILL[0]
        raise MlxEvictError(
            f"no DeepSeek-R1-Distill model fits {format_bytes(memory)} of memory: the smallest, "
            f"{smallest.repo}, needs about {format_bytes(smallest.need_nbytes)}; try the demo model (no MODEL)"
        )
    best = fitting[-1]
    choice = best
    skipped = ""
    if cached:
        have = [m for m in fitting if m.repo in cached]
        if not have:
            raise MlxEvictError(
                f"{best.repo} fits this machine but is not in the local hub cache and HF_HUB_OFFLINE is set; "
                f"fetch it with `hf download {best.repo}` (or unset HF_HUB_OFFLINE)"
            )
        choice = have[-1]
        if choice is not best:
            skipped = f"; {best.params} would fit but is not cached and HF_HUB_OFFLINE is set"
    kv = USEFUL_BUDGET * choice.kv_bytes_per_token
    reason = (
        f"chose {choice.repo}: {format_bytes(choice.weights_nbytes)} of weights + "
        f"{format_bytes(kv)} KV for a {USEFUL_BUDGET}-token budget + {format_bytes(choice.overhead_nbytes)} overhead "
        f"= {format_bytes(choice.need_nbytes)}, within the {format_bytes(usable)} a model may use of "
        f"{format_bytes(memory)}{skipped}"
    )
    larger = DEEPSEEK_R1_DISTILL.index(choice) + 1
    if not skipped and larger < len(DEEPSEEK_R1_DISTILL):
        nxt = DEEPSEEK_R1_DISTILL[larger]
        reason += f"; {nxt.params} needs {format_bytes(nxt.need_nbytes)}"
    return choice, reason


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
def gguf_folder(gguf: Path, dtype: Optional[str] = None) -> Path:
    """Where a GGUF file's conversion lives in the cache: keyed by path, size, mtime and dtype."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{gguf.stem}-{dtype or 'native'}-{digest}"


def convert_once(
    gguf: Path, *, dtype: Optional[str] = None, progress: bool = False, report: Optional[Report] = None
) -> Path:
    """Convert ``gguf`` into the cache unless an earlier run already did; return the folder."""
    out = gguf_folder(gguf, dtype)
    if (out / "config.json").is_file():
        return out
    from .convert import convert_gguf

    if report:
        report(f"converting {gguf.name} once into {out}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=gguf.stat().st_size, unit="B", unit_scale=True, desc="convert", file=sys.stderr)

    def advance(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        convert_gguf(gguf, out, dtype=dtype, force=True, progress=advance if bar else None)
    finally:
        if bar:
            bar.close()
    return out


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
) -> Resolved:
    """Find (and if needed fetch or convert) the model folder for what the user typed.

    Args:
        name: a folder, a ``.gguf`` file, ``org/name``, the family name
            ``mlx-community/DeepSeek-R1-Distill``, ``"demo"`` or ``None`` (the demo model).
        memory: total memory for the family choice; default this machine's.
        weights: ``False`` fetches only a hub repo's JSON files (enough for a memory plan).
        progress: show download and conversion progress bars on stderr.
        gguf_dtype: ``None`` keeps a GGUF's tensors as stored; ``"float16"``/``"float32"`` dequantizes.
        report: called with one human line for each decision worth telling (the family choice).

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
        return Resolved(convert_once(path, dtype=gguf_dtype, progress=progress, report=report), path.name, "gguf")
    if _looks_like_path(name):
        raise MlxEvictError(f"{name}: no such file or folder{suggest(name)}")
    if is_family_name(name):
        total = memory or psutil.virtual_memory().total
        cached = [m.repo for m in DEEPSEEK_R1_DISTILL if cached_snapshot(m.repo, weights=weights)]
        member, reason = choose_family_member(total, cached=cached if hub_offline() else ())
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
    """``mlx_lm.load`` the folder after checking its architecture; return ``(model, tokenizer)``."""
    check_architecture(resolved.path)
    from mlx_lm import load

    try:
        return load(str(resolved.path))
    except (ValueError, FileNotFoundError, OSError) as err:
        raise MlxEvictError(f"cannot load {resolved.name} from {resolved.path}: {err}") from None
