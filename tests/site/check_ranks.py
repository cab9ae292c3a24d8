"""A test's own rank script (tests/*_check.py) under torchrun as train_node starts it (ranks.py), the launcher importing
first the modules its first argument names, as ranks.py does for train.py (conftest.check_ranks_command):

    python check_ranks.py MODULE,MODULE,... --standalone --nproc_per_node 2 script.py args...

Here and not a `python -c` so that a job zygote can fork it (job_zygote.LAUNCHERS)."""

import sys

from workflow_scripts.train import ranks

ranks.preload(sys.argv.pop(1).split(","))
ranks.main()
