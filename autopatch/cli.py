"""Command line: ``autopatch run SCRIPT [ARGS]``, ``autopatch policy check|show|list``."""

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
