"""Audit 36s: does a candidate change greedy tokens / logits with no ulptrace involved (plain HF generate)?"""
import sys, torch
sys.path.insert(0, "bench/audit")
import audit36s_candidates as C
from ulptrace.models import build_model
name, model_name = sys.argv[1], sys.argv[2]
m = build_model(model_name, seed=0)
torch.manual_seed(0); p = torch.randint(0, 512, (2, 32))
def gen():
    with torch.no_grad():
        o = m.generate(p, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return o.sequences[:, 32:], torch.stack(o.logits)
a, la = gen(); undo = getattr(C, name)(m); b, lb = gen(); undo(); c, lc = gen()
print(name, model_name, "tokens same:", torch.equal(a, b), "| max |dlogit|:", (la - lb).abs().max().item(),
      "| after undo bitwise:", torch.equal(la, lc))
