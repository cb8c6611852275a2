import sys

from hkvd.daemon.cli import main

sys.exit(main())
