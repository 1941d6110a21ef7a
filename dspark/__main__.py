"""`python -m dspark` runs the command line."""

import sys

from dspark.cli import main

sys.exit(main())
