"""The orders job (rayflow.jobs.orders) as a script: python examples/orders.py --orders 50000"""

import sys

from rayflow.jobs.orders import main

sys.exit(main())
