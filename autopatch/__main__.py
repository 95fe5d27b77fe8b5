"""``python -m autopatch SCRIPT [ARGS]`` runs SCRIPT with autopatch enabled;
``python -m autopatch policy check FILE`` and the other subcommands work as ``autopatch``."""

import sys

from .cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] not in ("run", "policy", "-h", "--help"):
        argv = ["run", *argv]
    sys.exit(main(argv))
