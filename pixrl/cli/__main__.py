import sys

from . import app

sys.exit(app())
