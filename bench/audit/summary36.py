"""audit36's summary (an extended copy of summary.py): one row per run of ``audit36_runall.sh`` — the onset
(site@step:reason), the verdict counts and boundary at the onset record, the first difference, the kinds of parity
failure (PARITY when at parity), the records that could not be judged, the run's exit status; runs without a JSON report
(a crash) show their output's last line. Usage: python bench/audit/summary36.py OUT > OUT/summary.md"""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rcs = {}
if (out / "rc.txt").exists():
    for line in (out / "rc.txt").read_text().splitlines():
        m, c, rc, *rest = line.split()
        rcs[(m, c)] = (rc, rest[0] if rest else "")
print("| family | candidate | onset (site@step:reason) | verdicts at onset | boundary at onset | first difference | "
      "parity | cnj | rc |")
print("|---|---|---|---|---|---|---|---|---|")
for (m, c), (rc, secs) in sorted(rcs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    f = out / f"{m}.{c}.json"
    if not f.exists():
        txt = (out / f"{m}.{c}.txt").read_text().strip().splitlines()
        last = txt[-1] if txt else ""
        print(f"| {m} | {c} | NO REPORT: {last[:160]} | | | | | | {rc} {secs} |")
        continue
    d = json.loads(f.read_text())
    o, fd = d["onset"], d["first_difference"]
    onset = "none" if o is None else f"{o['site']}@{o['step']}:{o['reason']}"
    first = "none" if fd is None else f"{fd['site']}@{fd['step']}"
    verd = bnd = ""
    if o is not None:
        rec = next((s for s in d["sites"] if s["site"] == o["site"] and s["step"] == o["step"]), None)
        if rec is not None:
            v = rec.get("verdicts")
            verd = "null" if v is None else " ".join(f"{k}={n}" for k, n in v.items() if n)
            verd += f" (diff {rec['differing']}/{rec['elements']}, max_ulp {rec['max_ulp']})"
            bnd = (rec.get("boundary") or "")[:90]
    kinds = ",".join(sorted({x["kind"] for x in d["parity"]["failures"]})) or "PARITY"
    print(f"| {m} | {c} | {onset} | {verd} | {bnd} | {first} | {kinds} | {len(d['could_not_judge'])} | {rc} {secs} |")
