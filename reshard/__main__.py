import sys

from reshard.cli import main

sys.exit(main())
