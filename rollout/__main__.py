"""`python -m rollout ...` (the form used with `ray job submit`)."""

import sys

from rollout.commands.cli import main

sys.exit(main())
