import sys

from sarathi_rt.cli import main

sys.exit(main())
