"""Diagnostic programs built on the ulptrace core (``trace_norm_rounding``, onset)."""

if __name__ == "probes":  # this folder reached as a top-level package from the checkout's root
    from ulptrace._toplevel import step_aside

    step_aside(__name__, __file__, globals())
