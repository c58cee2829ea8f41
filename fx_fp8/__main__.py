"""`python -m fx_fp8 ...` runs the fx-fp8 command line."""

import sys

from fx_fp8.tools.cli import main

sys.exit(main())
