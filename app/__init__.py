"""The Textual TUI (installed as ``mlxevict.app``)."""
