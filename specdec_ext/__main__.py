import sys

from specdec_ext.cli import main

sys.exit(main())
