"""``python -m ulptrace`` runs the ``ulptrace`` command line."""

from ulptrace.cli import console

console()
