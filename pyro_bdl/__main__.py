import sys

from pyro_bdl.cli import main

sys.exit(main())
