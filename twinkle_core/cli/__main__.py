"""``python -m twinkle_core.cli``: the ``twinkle`` command."""

from twinkle_core.cli import main

main()
