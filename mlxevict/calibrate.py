"""Which layers a model's quantized KV hurts most: one layer quantized at a time, the rest exact.

The memory rule's low-bit storage (keys in 5 bits per channel, values in 3) costs some layers far
more than others: on the demo model one of 30 layers carries much of the error (docs/tiers.md).
Which one is the model's, so it is measured per model: a natural text is streamed into the model
with every layer in mlx-lm's exact ``KVCache`` but one, which holds the storage; the KL(exact ‖ this)
of the text's last tokens is that layer's error. :func:`sensitive_layers` picks the layers whose
error stands out; :func:`mlxevict.make_cache` stores those in 8 bits (``eight_bit_layers``).

The text should be one you do not evaluate on; ``mlxevict calibrate`` streams a text of the long
suite's tuning half. A calibration is kept per model under the mlxevict cache
(``~/.cache/mlxevict/calibration/``), named by :func:`fingerprint` (the model's geometry and norm
weights), so :func:`mlxevict.plan.plan_cache` finds it for a loaded model; the demo model's ships with
the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .defaults import cache_dir
from .errors import MlxEvictError
from .kvstorage import KVStorage

CALIBRATION_STORAGE = KVStorage.of((5, 3), 64, window_bits=8, key_group=64)  # the memory rule's high tier
CHUNK = 128  # tokens per streamed call
STANDS_OUT = 4.0  # a layer whose error is this many times the median's is sensitive (not tuned: one model)
MOST_LAYERS = 1  # at most this many layers in 8 bits (tuned: docs/tiers.md)
SHIPPED = Path(__file__).parent / "calibrations"  # the demo model's, measured by ``mlxevict calibrate demo``


@dataclass(frozen=True)
class Calibration:
    """Per-layer errors of a storage on a text, and the layers chosen from them.

    Attributes:
        errors: KL(exact ‖ one layer in ``storage``) per layer, nats per token.
        layers: the sensitive layers (:func:`sensitive_layers`), ascending.
        storage: the storage's suffix (``:k5v3w8c64``).
        tokens: the text's length; ``scored``: its last tokens scored.
        model: the model's :func:`fingerprint`; ``name``: what it was called when calibrated.
    """

    errors: tuple[float, ...]
    layers: tuple[int, ...]
    storage: str
    tokens: int
    scored: int
    model: str = ""
    name: str = ""

    def save(self, path: str | Path) -> Path:
        """Write it as JSON (a temporary file renamed, so a stopped run leaves no half file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        try:
            data = json.loads(Path(path).read_text())
            return cls(tuple(data["errors"]), tuple(data["layers"]), data["storage"], data["tokens"], data["scored"],
                       data.get("model", ""), data.get("name", ""))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise MlxEvictError(f"{path} is not a calibration file ({err})") from None


def sensitive_layers(errors: Sequence[float], stands_out: float = STANDS_OUT, most: int = MOST_LAYERS) -> tuple[int, ...]:
    """The ``most`` layers of largest error among those at least ``stands_out`` times the median's; ascending."""
    median = sorted(errors)[len(errors) // 2]
    ranked = sorted(range(len(errors)), key=lambda i: -errors[i])
    return tuple(sorted(i for i in ranked[:most] if errors[i] >= stands_out * median))


def fingerprint(model: nn.Module) -> str:
    """A short name for a model's weights, the same in any dtype, quantized or not, patched or not: its kind
    and layers, and which channels are largest in its first layer's and its last norm weights (small arrays,
    read without the rest: :func:`folder_fingerprint`)."""
    import numpy as np
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    h = hashlib.sha1(f"{getattr(args, 'model_type', '')}:{len(model.layers)}".encode())
    norms = [v for k, v in tree_flatten(model.layers[0].parameters()) if "norm" in k]
    inner = getattr(model, "model", None)
    if getattr(inner, "norm", None) is not None:
        norms.append(inner.norm.weight)
    for v in norms:
        order = np.argsort(-np.array(v.astype(mx.float32)), kind="stable")[:8]
        h.update(f"{v.shape[-1]}:{order.tolist()}".encode())
    return h.hexdigest()[:16]


def folder_fingerprint(path: str | Path) -> str:
    """:func:`fingerprint` of a model folder, its weights loaded lazily (only the norms are read)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True)
    return fingerprint(model)


def calibration_path(model: "nn.Module | str | Path") -> Path:
    """Where ``mlxevict calibrate`` keeps the calibration of this model (or model folder)."""
    name = fingerprint(model) if isinstance(model, nn.Module) else folder_fingerprint(model)
    return cache_dir() / "calibration" / f"{name}.json"


def find_calibration(model: "nn.Module | str | Path") -> Optional[Calibration]:
    """The calibration of this model (or model folder): the user's (``mlxevict calibrate``), else one shipped;
    ``None``: never calibrated.

    Raises:
        MlxEvictError: the file found cannot be read.
    """
    mine = calibration_path(model)
    for path in (mine, SHIPPED / mine.name):
        if path.is_file():
            return Calibration.load(path)
    return None


def saved_calibration(model_or_config: Any) -> Optional[Calibration]:
    """:func:`find_calibration` of a loaded model or a model folder; ``None`` for a config (no weights to name it
    by), a folder whose weights cannot be read (not downloaded yet), or an unreadable calibration file, which
    is said in a warning (the plan then keeps one tier everywhere, and the user should know why)."""
    known = isinstance(model_or_config, nn.Module) or (
        isinstance(model_or_config, (str, Path)) and Path(model_or_config).is_dir()
    )
    try:
        return find_calibration(model_or_config) if known else None
    except MlxEvictError as err:
        warnings.warn(f"{err}: planning without it; `mlxevict calibrate MODEL` writes it again")
        return None
    except (OSError, ValueError, KeyError, RuntimeError):  # the folder's weights: missing or unreadable
        return None


def _stream(model: nn.Module, caches: list[Any], tokens: mx.array, scored: int) -> mx.array:
    """Log-probabilities of the last ``scored`` positions, ``tokens`` fed in ``CHUNK``-token calls."""
    L = tokens.shape[1]
    out = []
    for s in range(0, L, CHUNK):
        logits = model(tokens[:, s : s + CHUNK], cache=caches)
        if s + CHUNK > L - scored:
            out.append(logits[:, max(0, L - scored - s) :].astype(mx.float32))
            mx.eval(out[-1])
        else:
            mx.eval(logits)
    logits = mx.concatenate(out, axis=1)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def layer_errors(
    model: nn.Module,
    tokens: Sequence[int],
    storage: KVStorage = CALIBRATION_STORAGE,
    scored: int = 256,
    progress: Optional[Callable[[int, int], None]] = None,
) -> list[float]:
    """KL(exact ‖ layer ``i`` alone in ``storage``) of the last ``scored`` tokens of ``tokens``, per layer.

    Nothing is evicted (each cache's budget is the text). ``progress(done, total)`` after each layer.
    """
    from mlx_lm.models.cache import KVCache

    from .make import make_cache

    if len(tokens) <= scored:
        raise MlxEvictError(f"a calibration text of {len(tokens)} tokens leaves none unscored; give more than {scored}")
    batch = mx.array([list(tokens)])
    exact = _stream(model, [KVCache() for _ in model.layers], batch, scored)
    p = mx.exp(exact)
    errors = []
    n = len(model.layers)
    for i in range(n):
        caches: list[Any] = [KVCache() for _ in range(n)]
        caches[i] = make_cache(model, "default", len(tokens), **storage.options())[i]
        lp = _stream(model, caches, batch, scored)
        errors.append(float((p * (exact - lp)).sum(axis=-1).mean().item()))
        if progress:
            progress(i + 1, n)
    if not all(math.isfinite(e) for e in errors):
        raise MlxEvictError("calibration gave a non-finite error; the model's logits overflow")
    return errors


def calibrate(model: nn.Module, tokens: Sequence[int], storage: KVStorage = CALIBRATION_STORAGE, scored: int = 256,
              progress: Optional[Callable[[int, int], None]] = None, name: str = "") -> Calibration:  # fmt: skip
    """:func:`layer_errors` and the layers :func:`sensitive_layers` picks from them (``name``: the model's, for people)."""
    errors = layer_errors(model, tokens, storage, scored, progress)
    return Calibration(tuple(round(e, 7) for e in errors), sensitive_layers(errors), storage.suffix, len(tokens), scored,
                       fingerprint(model), name)  # fmt: skip
