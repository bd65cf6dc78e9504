"""`python -m eagle3_zoo.cli ...` = `eagle3-zoo ...` (the entry Lightning relaunches for the other ranks of a
multi-process `fit`)."""

import sys

from eagle3_zoo.cli import main

sys.exit(main())
