"""How the advice states the figures it stands on, alike in every line."""


def share_of_step(report, part):
    b = report["breakdown"]
    return f"{100 * b['share'][part]:.0f}% of the step (median step {b['median_step_ms']:.3g} ms, {b['steps']} steps)"


def mib(n_bytes):
    return f"{n_bytes / 2**20:.0f} MiB"
