"""N (attention behind q_absorb) vs O (main): median us per phase and context, per round."""
import json, glob, sys, collections
d = sys.argv[1]
tab = collections.defaultdict(dict)
for f in sorted(glob.glob(f"{d}/ab_*.json")):
    tag = f.split("/")[-1][3:-5]          # N_h16_r1
    v, heads, r = tag.split("_")
    for row in json.load(open(f))["rows"]:
        if row["variant"] == "-" or row["phase"] in ("q_absorb",):
            continue
        tab[(heads, row["n_ctx"], row["phase"])][f"{v}{r[1:]}"] = row["median_us"]
    for row in json.load(open(f))["rows"]:
        if row["phase"] == "q_absorb" and row.get("control_label") == "start":
            tab[(heads, "-", "q_absorb")][f"{v}{r[1:]}"] = row["median_us"]
for k in sorted(tab, key=str):
    print(k, " ".join(f"{c}={x:.1f}" for c, x in sorted(tab[k].items())))
