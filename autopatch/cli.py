"""Command line: ``autopatch run SCRIPT [ARGS]``, ``autopatch policy check|list``."""

import argparse
import json
import os
import runpy
import sys

from . import env, policy as _policy


def _run(args):
    """Run a script (or ``-m module``) with autopatch enabled, as FUSEDOPT_ENABLE=1 would."""
    os.environ[env.ENABLE] = "1"          # child processes (torchrun workers, spawn) inherit it
    if args.policy:
        os.environ[env.POLICY] = args.policy
    _bagua_flags(args)
    if args.enable_bagua_net:
        _nccl_sockets()
    from . import _startup
    _startup.run()
    if args.module:
        sys.argv = [args.target, *args.args]
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [args.target, *args.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.target)))
        runpy.run_path(args.target, run_name="__main__")
    return 0


def _bagua_flags(args):
    """Bagua's autotune flags, passed on as environment so every process of the job sees them."""
    for value, var in ((args.autotune_max_samples, env.AUTOTUNE_MAX_SAMPLES),
                       (args.autotune_sampling_confidence_time, env.AUTOTUNE_TRIAL_SECONDS),
                       (args.autotune_warmup_time, env.AUTOTUNE_WARMUP_SECONDS)):
        if value is not None:
            os.environ[var] = str(value)
    if args.autotune_level is not None:
        os.environ[env.AUTOTUNE] = "1" if args.autotune_level > 0 else "0"
    if args.is_output_autotune_log:
        try:
            chosen = _policy.load(os.environ.get(env.POLICY), env_overrides=env.policy_overrides())
        except _policy.PolicyError:
            return   # start-up reports the invalid policy
        path = chosen.autotune.log_csv or _new_autotune_log()
        if path is not None:
            print(f"autopatch: autotune log: {path}", file=sys.stderr)


def _new_autotune_log():
    """A fresh name, as Bagua's was in the temp dir, but in this user's private directory there
    (reporting/files.py): no other user can read it, or plant a link where it goes. Its path goes to
    every process of the job through FUSEDOPT_AUTOTUNE_LOG; None, after a warning, when the
    private directory cannot be used (the run goes on without the CSV)."""
    from .reporting.files import private_folder
    try:
        with private_folder() as folder:
            name, f = folder.create("autopatch_autotune_", ".log")
            f.close()
    except OSError as e:
        print(f"autopatch: --is_output_autotune_log: no trials CSV: {e}", file=sys.stderr)
        return None
    os.environ[env.AUTOTUNE_LOG] = path = os.path.join(folder.path, name)
    return path


# NCCL's own multi-socket transport, in place of Bagua-Net: NCCL loads net plugins of interface v6
# and later only (v4, the one Bagua-Net exports, was removed in NCCL 2.19). NCCL allows at most 64
# sockets per connection (threads x sockets per thread).
NCCL_SOCKETS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}


def _nccl_sockets():
    """Set NCCL's socket threads before any process group starts (children inherit them); a
    value the user set is kept."""
    for var, value in NCCL_SOCKETS.items():
        os.environ.setdefault(var, value)
    chosen = " ".join(f"{var}={os.environ[var]}" for var in NCCL_SOCKETS)
    print(f"autopatch: --enable_bagua_net: Bagua-Net cannot load in current NCCL (its plugin interface, v4, "
          f"was removed in NCCL 2.19); using NCCL's own multi-socket transport instead: {chosen}",
          file=sys.stderr)


def _check(args):
    try:
        pol = _policy.load(args.policy, env_overrides=env.policy_overrides() if args.env else None)
    except _policy.PolicyError as e:
        print(f"autopatch: invalid policy: {e}", file=sys.stderr)
        return 2
    print(f"# {pol.source}: valid (policy version {pol.version})")
    print(json.dumps(pol.to_dict(), indent=2, default=list))
    return 0


def _list(args):
    for name in _policy.builtin_names():
        print(name)
    return 0


def parser():
    p = argparse.ArgumentParser(prog="autopatch", description="Faster PyTorch training, no code changes.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a training script with autopatch enabled")
    r.add_argument("--policy", help="builtin policy name or YAML path (default: FUSEDOPT_POLICY or 'default')")
    r.add_argument("-m", dest="module", action="store_true", help="run TARGET as a module, like python -m")
    bagua = r.add_argument_group("autotune, with Bagua's flags")
    bagua.add_argument("--autotune_level", type=int, choices=(0, 1), help="1: autotune (autotune.enabled)")
    bagua.add_argument("--autotune_max_samples", type=int, metavar="N", help="at most N trials (autotune.max_samples)")
    bagua.add_argument("--autotune_sampling_confidence_time", type=float, metavar="S",
                       help="seconds measured per trial (autotune.trial_seconds)")
    bagua.add_argument("--autotune_warmup_time", type=float, metavar="S",
                       help="seconds before the first trial (autotune.warmup_seconds)")
    bagua.add_argument("--is_output_autotune_log", action="store_true",
                       help="write the trials CSV (autotune.log_csv, else a new file in the temp dir)")
    r.add_argument("--enable_bagua_net", action="store_true",
                   help="Bagua's flag: NCCL's own multi-socket transport (NCCL_SOCKET_NTHREADS, "
                        "NCCL_NSOCKS_PERTHREAD), since Bagua-Net cannot load in current NCCL")
    r.add_argument("target", help="the script (or module with -m)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    r.set_defaults(func=_run)
    pol = sub.add_parser("policy", help="inspect policies")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    c = psub.add_parser("check", help="validate a policy and print the effective settings")
    c.add_argument("policy", help="builtin name or YAML path")
    c.add_argument("--env", action="store_true", help="apply FUSEDOPT_* overrides from the environment")
    c.set_defaults(func=_check)
    ls = psub.add_parser("list", help="list the builtin policies")
    ls.set_defaults(func=_list)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
