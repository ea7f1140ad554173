"""``python -m engines.pool --host IP ...``: run the pool's master in the foreground until SIGTERM
(``engines.pool.master.main``; a cluster's head runs it from ``deploy/node-setup.sh pool``)."""

import sys

from engines.pool.master import main

sys.exit(main())
