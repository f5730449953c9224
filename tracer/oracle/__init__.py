"""The FP64 oracle: reference semantics, interval replay, and per-element verdicts."""
