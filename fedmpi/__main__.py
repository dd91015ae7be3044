"""``python -m fedmpi`` = the ``fedmpi`` console script."""
import sys

from .cli import main

sys.exit(main())
