"""Diagnostic programs built on the ulptrace core (``trace_norm_rounding``, onset)."""
