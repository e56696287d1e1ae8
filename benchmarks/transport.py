"""Transport benchmark: ``python benchmarks/transport.py [--json] [--quick]``.

Same as ``atoll bench transport``; see ``atoll.transports.capnp.bench``.
"""

import sys

from atoll.transports.capnp.bench import main

if __name__ == "__main__":
    sys.exit(main())
