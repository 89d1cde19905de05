"""``python -m hipattn``: the same command as the ``hipattn`` console script."""

import sys

from .cli import main

# The guard matters: `warm` spawns worker processes, which re-import this module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
