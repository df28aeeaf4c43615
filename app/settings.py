"""A small dialog to choose the eviction policy and the KV budget for the next turn."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from mlxevict.policies import policy_names


class SettingsScreen(ModalScreen[tuple[str, int] | None]):
    """Dismisses with ``(policy, budget)``, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, policy: str, budget: int) -> None:
        super().__init__()
        self.policy = policy
        self.budget = budget

    def compose(self) -> ComposeResult:
        names = policy_names()
        if self.policy not in names:
            names.append(self.policy)
        with Vertical(id="settings"):
            yield Label("Policy and budget for the next turn", id="settings-title")
            yield Label("Policy")
            yield Select([(n, n) for n in names], value=self.policy, allow_blank=False, id="policy")
            yield Label("Budget (KV entries per layer)")
            yield Input(str(self.budget), type="integer", id="budget")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#apply")
    @on(Input.Submitted, "#budget")
    def apply(self) -> None:
        text = self.query_one("#budget", Input).value.strip()
        budget = int(text) if text.isdigit() else 0
        if budget <= 0:
            self.query_one("#settings-error", Label).update(f"budget {text!r} is not a positive number of tokens")
            return
        self.dismiss((str(self.query_one("#policy", Select).value), budget))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
