"""One line per run of audit39c_runall.sh: rc, parity, complete, onset, first difference, failures, selection."""
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
rcs = {l.split()[0]: l.split()[1] for l in (out / "rc.txt").read_text().splitlines()}
for label, rc in rcs.items():
    j = out / f"{label}.json"
    txt = (out / f"{label}.txt").read_text()
    if not j.exists() or j.stat().st_size == 0:
        print(f"{label:55s} {rc} NOJSON :: {txt.strip().splitlines()[-1][:200] if txt.strip() else ''}")
        continue
    d = json.loads(j.read_text())
    p = d.get("parity", {})
    o, f = d.get("onset"), d.get("first_difference")
    fs = lambda x: f"{x['site']}@{x['step']}" + (f"({x.get('reason')})" if x.get('reason') else "") if x else None
    kinds = ",".join(f"{x['kind']}:{x['records']}" for x in p.get("failures", []))
    verd = {}
    for s in d.get("sites", []):
        for k, v in (s.get("verdicts") or {}).items():
            if k != "exact" and v:
                verd[k] = verd.get(k, 0) + v
    diff = sum(1 for s in d.get("sites", []) if not s.get("bitwise_equal"))
    flip = (d.get("run") or {}).get("first_flip", (d.get("run") or {}).get("flip"))
    par = re.search(r"^parity: .*$", txt, re.M)
    print(f"{label:55s} {rc} ok={p.get('ok')} complete={d.get('complete')} onset={fs(o)} first={fs(f)} "
          f"fail=[{kinds}] differing_recs={diff} verdicts={verd} | {par.group(0) if par else ''}")
