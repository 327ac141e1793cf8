"""``python -m hybridpar``: the same as the ``hybridpar`` command (``torchrun -m hybridpar train ...``)."""

import sys

from hybridpar.cli import main

sys.exit(main())
