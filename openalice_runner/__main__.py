import sys

from openalice_runner.cli import main

sys.exit(main())
