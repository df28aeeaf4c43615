"""``mlxevict serve``: an OpenAI-compatible HTTP server whose every conversation stays within its KV budget.

:mod:`.protocol` reads and writes the OpenAI JSON, :mod:`.engine` runs the
requests in order on one worker thread, :mod:`.store` keeps finished
conversations for their next turn, :mod:`.http` is the standard library's
threading HTTP server in front of it all.
"""

from .engine import Engine
from .http import ApiServer
from .protocol import ApiError, Defaults
from .store import ConversationStore

__all__ = ["ApiError", "ApiServer", "ConversationStore", "Defaults", "Engine"]
