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
        auto = o.get("auto")
        if auto and auto.get("ms_per_step"):
            times = ", ".join(f"{m} {t:.3f}" for m, t in auto["ms_per_step"].items())
            lines.append(f"    auto measured whole training steps ({times} ms/step; chose {auto['chosen']}, "
                         f"{auto['speedup_vs_off']:.2f}x unpatched), spending {auto['measure_steps']} steps "
                         f"({auto['measure_seconds']:.2f} s) measuring over {len(auto['measurements'])} "
                         f"measurement(s) of at most {auto['measure_steps_limit']} steps")
        for i in o.get("incidents", []):
            lines.append(f"    step {i['step']}: left {i['left']} for {i['for']}: {i['what']}"
                         + (" (that step's update differs from unpatched)" if i["update_differs"] else ""))
    algorithm = (report.get("allreduce") or {}).get("algorithm")
    if algorithm and report["allreduce"]["active"]:
        settings = ", ".join(f"{k} {v}" for k, v in algorithm["settings"].items())
        extra = "".join(f", {k.replace('_', ' ')} {algorithm[k]}" for k in ("averaging_rounds", "phase") if k in algorithm)
        lines.append(f"  communication: {algorithm['name']} ({settings}): {algorithm['bytes_sent_per_step']} bytes "
                     f"sent per step, {algorithm['wait_seconds']:.3f} s waiting{extra}")
    return "\n".join(lines)

