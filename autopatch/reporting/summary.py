"""The report in a few lines, for stderr at exit (``FUSEDOPT_ENABLE=1`` runs)."""


def summary(report):
    lines = [f"autopatch: policy {report['policy']}, {len(report['optimizers'])} optimizer(s)"]
    for o in report["optimizers"]:
        ms = 1e3 * o["step_seconds"] / o["steps"] if o["steps"] else 0.0
        lines.append(f"  {o['class']}: {o['mode']} over {o['params']} params, {o['steps']} steps, "
                     f"{ms:.3f} ms/step - {o['reason']}")
        route = o.get("route")
        if route and route["deviation"] is not None:
            lines.append(f"    route {route['route']}: probe deviation {route['deviation']:.2g} (relative, "
                         f"bound {route['bound']:.2g}) - {route['why']}")
        elif route and route["why"] != "fusion.exact: bitwise":
            lines.append(f"    route {route['route']} - {route['why']}")
        if o.get("shard"):
            lines.append("    " + _shard_line(o["shard"]))
        auto = o.get("auto")
        if auto and auto.get("ms_per_step"):
            lines.append("    " + _auto_line(auto, o["steps"], report["timing"].get("wall_seconds")))
        for i in o.get("incidents", []):
            lines.append(f"    step {i['step']}: left {i['left']} for {i['for']}: {i['what']}"
                         + (" (that step's update differs from unpatched)" if i["update_differs"] else ""))
    algorithm = (report.get("allreduce") or {}).get("algorithm")
    if algorithm and report["allreduce"]["active"]:
        settings = ", ".join(f"{k} {v}" for k, v in algorithm["settings"].items())
        extra = "".join(f", {k.replace('_', ' ')} {algorithm[k]}" for k in ("averaging_rounds", "phase") if k in algorithm)
        topology = report["allreduce"].get("topology")
        nodes = "" if topology is None else (f" on {topology['nodes']} node(s) of {'+'.join(map(str, topology['ranks_per_node']))} "
                                             f"ranks (leaders {', '.join(map(str, topology['leaders']))})")
        lines.append(f"  communication: {algorithm['name']} ({settings}){nodes}: {algorithm['bytes_sent_per_step']} "
                     f"bytes sent per step, {algorithm['wait_seconds']:.3f} s waiting{extra}")
    lines += _breakdown_lines(report)
    not_written = _not_written(report)
    if not_written:
        lines.append("  not written (training went on): " + "; ".join(not_written))
    return "\n".join(lines)


def _shard_line(shard):
    """Whether the optimizer state is sharded, what each rank holds, and what it costs per step."""
    if "ranks" not in shard:
        return f"state not sharded: {shard['reason']}"
    mib = 1 / 2**20
    line = (f"state sharded over {shard['ranks']} ranks: {shard.get('state_bytes', 0) * mib:.2f} MiB of optimizer "
            f"state on rank {shard['rank']} (unsharded {shard.get('state_bytes_unsharded', 0) * mib:.2f} MiB); "
            f"{shard.get('gather_bytes_per_step', 0) * mib:.2f} MiB of weights received per step in "
            f"{shard.get('broadcasts_per_step', 0)} broadcasts")
    if shard.get("unsharded_params"):
        line += f"; {shard['unsharded_params']} params outside flat runs keep their whole state on every rank"
    return line + (f"; sharding stopped: {shard['stopped']}" if shard.get("stopped") else "")


NAMES = {"data": "data wait", "comm": "communication wait"}


def _breakdown_lines(report):
    """Where this process's step time went, and the advice those figures back."""
    b = report.get("breakdown") or {}
    if not b.get("steps"):
        return []
    shares = ", ".join(f"{NAMES.get(p, p)} {100 * s:.0f}%" for p, s in b["share"].items() if s)
    return ([f"  step time (rank {report.get('rank', 0)}, median step {b['median_step_ms']:.3f} ms over "
             f"{b['steps']} steps): {shares}"]
            + [f"  advice ({a['about']}): {a['advice']}" for a in report.get("advice", [])])


def _not_written(report):
    """The output files that went off during the run, and why (each said once on stderr then)."""
    board, tune = report.get("tensorboard") or {}, report.get("autotune") or {}
    return [f"{what}: {why}" for what, why in ((f"TensorBoard logs in {board.get('logdir')}", board.get("failed")),
                                               (f"the trials CSV {tune.get('log_csv')}", tune.get("log_csv_failed")),
                                               ("the best config", tune.get("best_json_failed"))) if why]


def _auto_line(auto, steps, wall_seconds):
    """What mode auto measured, what it chose, and what measuring cost the run."""
    times = ", ".join(f"{m} {t:.3f}" for m, t in auto["ms_per_step"].items())
    share = f"{auto['measure_steps']} of {steps} steps ({100 * auto['measure_steps'] / max(steps, 1):.0f}%)"
    if wall_seconds:
        share += (f" and {auto['measure_seconds']:.2f} s of the run's {wall_seconds:.2f} s "
                  f"({100 * auto['measure_seconds'] / wall_seconds:.0f}%)")
    dropped = "; ".join(f"dropped {m} at step {d['step']} ({d['why']})" for m, d in auto.get("dropped", {}).items())
    return (f"auto measured whole training steps ({times} ms/step) and chose {auto['chosen']}, "
            f"{auto['speedup_vs_off']:.2f}x unpatched; measuring took {share} over "
            f"{len(auto['measurements'])} measurement(s) of at most {auto['measure_steps_limit']} steps"
            + (f"; {dropped}" if dropped else ""))
