"""``python -m fedmpi`` = the ``fedmpi`` console script."""
from fedmpi.cli import entry

entry()
