"""The ``mlxevict`` subcommands, one module each; ``cli.py`` wires their ``add_*_parser`` functions."""
