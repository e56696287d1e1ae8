"""``python -m atoll.transports.capnp.node``: run one node process."""

import sys

from ._process import main

if __name__ == "__main__":
    sys.exit(main())
