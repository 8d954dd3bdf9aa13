import sys

from megarl.cli import main

sys.exit(main())
