import sys

from jaxtp.cli.launch import main

sys.exit(main())
