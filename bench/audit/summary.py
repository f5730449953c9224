"""One line per audit run (``audit31_runall.sh``'s JSON reports): the onset (site@step:reason), the kinds of parity
failure (PARITY when at parity) and how many records could not be judged — to read a whole audit at a glance and to
diff two trees' audits line by line."""
import json
import sys
from pathlib import Path

for f in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    o = d["onset"]
    onset = "none" if o is None else f"{o['site']}@{o['step']}:{o['reason']}"
    kinds = ",".join(sorted({x["kind"] for x in d["parity"]["failures"]})) or "PARITY"
    print(f"{f.stem:<56} {onset:<45} {kinds:<28} could_not_judge={len(d['could_not_judge'])}")
