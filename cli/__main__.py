"""`python -m phasescope.cli ...`: the `phasescope` command line."""

import sys

from .main import main

sys.exit(main())
