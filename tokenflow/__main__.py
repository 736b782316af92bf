import sys

from tokenflow.cli import main

sys.exit(main())
