"""`python -m eagle3_zoo ...` = `eagle3-zoo ...`."""

import sys

from eagle3_zoo.cli import main

sys.exit(main())
