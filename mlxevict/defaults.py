"""The defaults and names that ``--help`` shows, in a module that imports nothing.

The modules that use them (``cache``, ``quantized``, ``generate``, ``resolve``)
import them from here, so the command line can print its help without loading
MLX or mlx-lm.
"""

from pathlib import Path

DEFAULT_BUDGET = 2048
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32  # at most; never more than budget // 8 unless asked (or the policy says otherwise)
DEFAULT_GROUP_SIZE = 64  # mlx-lm's --kv-group-size default
DEFAULT_MAX_TOKENS = 4096
FAMILY_NAME = "mlx-community/DeepSeek-R1-Distill"
LAUNCH_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # set by mlx.launch (ring) or mpirun
CACHE_ENV = "MLXEVICT_CACHE"


def cache_dir() -> Path:
    """The mlxevict cache (the demo model, GGUF conversions, calibrations): ``$MLXEVICT_CACHE``, else
    ``~/.cache/mlxevict``."""
    import os

    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlxevict").expanduser()


def started_by_launcher() -> bool:
    """Whether ``mlx.launch`` (or ``mpirun``) started this process: read from the environment, no MLX import."""
    import os

    return any(name in os.environ for name in LAUNCH_VARIABLES)
