import sys

from eyrie.cli import main

sys.exit(main())
