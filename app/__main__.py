"""`python -m app start|stop|status`: see app/launcher.py."""
import sys

from app.launcher import main

sys.exit(main())
