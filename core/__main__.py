"""`python -m core`: the command line."""

import sys

from core.process import configure

configure()  # before torch loads (core.cli.main imports it)

from core.cli.main import main  # noqa: E402

sys.exit(main())
