"""pytest plugin for ulptrace (registered through the ``pytest11`` entry point ``ulptrace``).

Placeholder while the plugin is written: it exists so that pytest can load the entry point. Importing it
imports only pytest and has no side effects.
"""

from __future__ import annotations

import pytest  # noqa: F401
