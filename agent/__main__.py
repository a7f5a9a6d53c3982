import sys

from nodemedic.cli import main

sys.exit(main())
