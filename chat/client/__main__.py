"""``python -m chat.client``."""
import sys

from . import main

sys.exit(main())
