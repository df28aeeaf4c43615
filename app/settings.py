"""The settings of the next turn: a dialog (Ctrl-O) for policy, budget and KV storage, read as the CLI reads them.

The budget takes what ``--budget`` takes (``2048``, ``1.5GB``, ``auto``) and the
storage what ``--kv-bits`` takes (``8``, ``4``, ``5,3``, ``none``; empty: the
planner's rule), parsed by the same functions, so ``20MB`` means 20 MB of KV here
as on the command line. :func:`configure` hands them to the session's planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from mlxevict.budget import parse_budget
from mlxevict.kvstorage import KVStorage
from mlxevict.policies import policy_names


KEEP_STORAGE = "keep"  # choose_settings: the storage asked for so far


def storage_label(session: Any) -> str:
    """``"5/3-bit"`` when the session's caches are quantized, ``"evicted to disk"`` with a page store, else ``""``."""
    if getattr(session, "paged", False):
        return "evicted to disk"
    storage = getattr(session, "storage", None)
    return storage.label if isinstance(storage, KVStorage) and storage.quantized else ""


@dataclass(frozen=True)
class Choice:
    """Settings for the next turn: a policy, a budget as written, and a storage (``None``: the rule)."""

    policy: str
    budget: str
    storage: Optional[KVStorage] = None


@dataclass(frozen=True)
class Applied:
    """What a session runs with after :func:`configure`: tokens, the budget as written, the storage, notes."""

    tokens: int
    budget: str
    storage: str = ""
    notes: tuple[str, ...] = ()


def read_choice(policy: str, budget: str, kv_bits: str) -> Choice:
    """Parse the dialog's fields as the CLI parses ``--budget`` and ``--kv-bits``.

    Raises:
        ValueError: the CLI's one-line message for a bad budget or storage.
    """
    request = parse_budget(budget.strip() or None)
    storage = KVStorage.parse(kv_bits) if kv_bits.strip() else None
    return Choice(policy, request.text if not request.default else str(request.tokens), storage)


def configure(session: Any, choice: Choice) -> Applied:
    """Apply ``choice`` to ``session``: through its planner (``replan``) when it has one, else ``set_policy``
    with a budget in tokens (a session without a model cannot size memory).

    Raises:
        ValueError: settings that cannot work; the session keeps its old ones.
    """
    request = parse_budget(choice.budget)
    replan = getattr(session, "replan", None)
    if replan is not None:
        plan = replan(request, choice.storage, policy=choice.policy)
        return Applied(plan.tokens, request.text, storage_label(session), plan.notes)
    if request.tokens is None or choice.storage is not None:
        raise ValueError(f"budget {request.text!r}: this session takes a budget in tokens and no --kv-bits")
    session.set_policy(choice.policy, request.tokens)
    return Applied(request.tokens, request.text)


class SettingsScreen(ModalScreen[Optional[Choice]]):
    """Dismisses with a :class:`Choice`, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, policy: str, budget: "int | str", storage: Optional[KVStorage] = None) -> None:
        super().__init__()
        self.policy = policy
        self.budget = str(budget)
        self.storage = storage
        self.kv_bits = storage.bits_text if storage is not None else ""

    def compose(self) -> ComposeResult:
        names = policy_names()
        if self.policy not in names:
            names.append(self.policy)
        with Vertical(id="settings"):
            yield Label("Policy, budget and storage for the next turn", id="settings-title")
            yield Label("Policy")
            yield Select([(n, n) for n in names], value=self.policy, allow_blank=False, id="policy")
            yield Label("Budget: tokens (2048), KV memory (1.5GB) or auto")
            yield Input(self.budget, id="budget")
            yield Label("KV bits: 8, 4, 5,3 or none (empty: chosen for the budget)")
            yield Input(self.kv_bits, id="kv-bits")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#apply")
    @on(Input.Submitted, "#budget")
    @on(Input.Submitted, "#kv-bits")
    def apply(self) -> None:
        policy = str(self.query_one("#policy", Select).value)
        kv_bits = self.query_one("#kv-bits", Input).value
        try:
            choice = read_choice(policy, self.query_one("#budget", Input).value, kv_bits)
        except ValueError as err:
            self.query_one("#settings-error", Label).update(str(err))
            return
        if kv_bits.strip() == self.kv_bits:  # unchanged: keep its group size and windows too
            choice = Choice(choice.policy, choice.budget, self.storage)
        self.dismiss(choice)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
