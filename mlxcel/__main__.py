"""``python -m mlxcel``: the same as the ``mlxcel`` command."""

import sys

from mlxcel.cli import main

sys.exit(main())
