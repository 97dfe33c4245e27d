"""``python -m pipeline.job.report OUT``: write the run report of the job output OUT."""
import sys

from . import main

sys.exit(main())
