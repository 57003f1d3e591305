import sys

from pyro_bdl.app.cli import main

sys.exit(main())
