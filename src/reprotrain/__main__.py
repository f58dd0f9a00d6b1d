"""``python -m reprotrain <command>``: the ``reprotrain`` console script without installing it
(the container runs from ``PYTHONPATH``)."""

import sys

from reprotrain.commands import main

if __name__ == "__main__":
    sys.exit(main())
