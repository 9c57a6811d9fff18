"""The orders job (rayflow.jobs.orders) as a script.

rayflow run --example orders --orders 50000     # or: python -m rayflow.examples.orders
"""

import sys

from rayflow.jobs.orders import main

if __name__ == "__main__":
    sys.exit(main())
