import sys

from jaxtp.launch import main

sys.exit(main())
