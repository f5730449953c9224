"""Audit 36s: does anything leave the attention registry's LOCAL mapping set after a tap or SideNames.entered()?"""
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as reg, AttentionInterface
from ulptrace.taps import tap
from ulptrace.sides import SideNames
from ulptrace.models import build_model

orig = AttentionInterface._global_mapping["sdpa"]
print("start local:", dict(reg._local_mapping))
h = tap(reg, "sdpa").add_observer(lambda *a: None); h.remove()
print("after a tap added+removed, local:", {k: getattr(v, "__name__", v) for k, v in reg._local_mapping.items()})
reg._local_mapping.clear()

def bad(*a, **k): return orig(*a, **k)
m = build_model("tiny-llama")
names = SideNames(m)                      # taken before the candidate's path (reference side)
AttentionInterface.register("sdpa", bad)  # candidate path: class-level global mapping
with names.entered():
    print("inside reference side: reg['sdpa'] is orig:", reg["sdpa"] is orig)
AttentionInterface.register("sdpa", orig) # candidate's undo
print("after candidate undo: reg['sdpa'] is orig:", reg["sdpa"] is orig, "; local:",
      {k: getattr(v, "__name__", v) for k, v in reg._local_mapping.items()})
