"""``python -m fedmpi`` = the ``fedmpi`` console script."""
from .cli import entry

entry()
