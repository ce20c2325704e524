"""`python -m cadence.cli`: the `cadence` command."""

import sys

from cadence.cli import main

sys.exit(main())
