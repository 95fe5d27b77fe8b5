"""Waiting for batches stands out: what the data cache would do for the datasets the loop iterated,
what it did if it ran, and the loaders' worker counts."""

from .figures import share_of_step
from .thresholds import DATA_WAIT_SHARE


def advise(report):
    b = report["breakdown"]
    if b["share"]["data"] < DATA_WAIT_SHARE:
        return []
    waited = f"waiting for the next batch is {share_of_step(report, 'data')}"
    datasets = (b.get("data") or {}).get("datasets", [])
    cache = ((report.get("data") or {}).get("cache") or {})
    out = []
    if cache.get("enabled"):
        for d in cache.get("datasets", []):
            out.append(f"{waited} with the data cache serving {d['dataset']} ({d['decided']}; "
                       f"{d.get('hits', 0)} hits, {d.get('misses', 0)} misses)")
        for d in cache.get("uncached", []):
            out.append(f"{waited}, and the data cache left {d['dataset']} uncached: {d['reason']}")
    else:
        for d in datasets:
            if d["map_style"]:
                out.append(f"{waited}: FUSEDOPT_DATA_CACHE=1 would serve {d['dataset']} (map-style, "
                           f"{d['samples']} samples) from the sample cache after its first epoch, once its "
                           "probe finds each sample a function of its index and reading one back faster "
                           "than loading it (the report's data section then says what it decided)")
            else:
                out.append(f"{waited}: {d['dataset']} is an iterable dataset, which the data cache cannot "
                           "serve (it has no index)")
    for d in datasets:
        if d["workers"] == 0:
            out.append(f"{waited}: the DataLoader over {d['dataset']} has num_workers=0, so every batch "
                       "loads in the training process between steps; DataLoader(num_workers=N) loads "
                       "the next ones while the step runs")
    return [{"about": "data", "advice": text} for text in out]
