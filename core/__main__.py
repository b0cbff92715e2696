"""`python -m core`: the command line."""

import sys

from core.cli.main import main

sys.exit(main())
