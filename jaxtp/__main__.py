import sys

from jaxtp.cli import main

sys.exit(main())
